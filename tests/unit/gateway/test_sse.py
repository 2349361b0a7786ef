"""SSE framing, and keep-alives while a request is silent."""

from __future__ import annotations

import asyncio

from libs.protocol.codec import pack_tokens
from libs.protocol.messages import FinishReason, RequestOutput
from services.gateway.generation import KEEPALIVE, Event, numbered
from services.gateway.request_stream import Pending, RequestStream
from services.gateway.sse import frame


def test_frames_carry_id_name_and_compact_json() -> None:
    assert frame(Event("message_stop", {"type": "message_stop"}), 7) == (
        'id: 7\nevent: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    assert frame(Event(None, "[DONE]"), 3) == "id: 3\ndata: [DONE]\n\n"
    assert frame(Event(None, {"a": "é"})) == 'data: {"a":"é"}\n\n'
    assert frame(KEEPALIVE) == ": keep-alive\n\n"


async def test_silence_gets_keepalives_and_nothing_is_lost() -> None:
    pending = Pending(1, False)
    stream = RequestStream("r", pending, lambda _: None, lambda _s, _f: None)
    got: list[object] = []

    async def read() -> None:
        async for delta in stream.deltas(0.01):
            got.append(delta)
            if got.count(None) == 3:
                pending.accept(RequestOutput("r", pack_tokens([5]), 1, 2))
                pending.accept(RequestOutput("r", pack_tokens([6]), 2, 2, FinishReason.STOP))

    await asyncio.wait_for(read(), 5)
    assert got[:3] == [None, None, None]
    assert [d.token_ids for d in got[3:] if d is not None] == [[5], [6]]


async def test_keepalives_have_no_ordinal() -> None:
    async def events():  # type: ignore[no-untyped-def]
        for event in (Event(None, "a"), KEEPALIVE, Event(None, "b")):
            yield event

    assert [(o, e.data) async for o, e in numbered(events())] == [(0, "a"), (None, ""), (1, "b")]
    assert [(o, e.data) async for o, e in numbered(events(), after=0)] == [(None, ""), (1, "b")]
