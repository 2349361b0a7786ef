"""SSE framing and keep-alive comments."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.gateway.generation import Event
from services.gateway.sse import KEEPALIVE, frame, with_keepalive


def test_frames_carry_id_name_and_compact_json() -> None:
    assert frame(Event("message_stop", {"type": "message_stop"}), 7) == (
        'id: 7\nevent: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    assert frame(Event(None, "[DONE]"), 3) == "id: 3\ndata: [DONE]\n\n"
    assert frame(Event(None, {"a": "é"})) == 'data: {"a":"é"}\n\n'


async def test_silence_gets_keepalive_comments_and_frames_keep_their_order() -> None:
    gate = asyncio.Event()

    async def source() -> AsyncIterator[str]:
        yield "a"
        await gate.wait()  # a request waiting in the queue
        yield "b"
        yield "c"

    out: list[str] = []

    async def consume() -> None:
        async for piece in with_keepalive(source(), 0.01):
            out.append(piece)
            if out.count(KEEPALIVE) == 3:
                gate.set()

    await asyncio.wait_for(consume(), 5)
    assert out[0] == "a" and out[-2:] == ["b", "c"]
    assert set(out[1:-2]) == {KEEPALIVE} and len(out) >= 6


async def test_closing_early_stops_the_source() -> None:
    closed = asyncio.Event()

    async def source() -> AsyncIterator[str]:
        try:
            while True:
                yield "x"
                await asyncio.sleep(0)
        finally:
            closed.set()

    stream = with_keepalive(source(), 1.0)
    assert await anext(stream) == "x"
    await stream.aclose()  # the client went away
    await asyncio.wait_for(closed.wait(), 1)
