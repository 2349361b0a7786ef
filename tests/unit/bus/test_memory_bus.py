from __future__ import annotations

import asyncio

import pytest

from libs.bus.base import Message, NoResponders, RequestTimeout
from libs.bus.memory import InMemoryBus, subject_matches


@pytest.mark.parametrize(
    ("pattern", "subject", "match"),
    [
        ("a.b", "a.b", True),
        ("a.*", "a.b", True),
        ("a.*", "a.b.c", False),
        ("a.>", "a.b.c", True),
        ("a.>", "a", False),
        ("a.b", "a.c", False),
    ],
)
def test_subject_matches(pattern: str, subject: str, match: bool) -> None:
    assert subject_matches(pattern, subject) is match


def test_request_reply_queue_group_and_errors() -> None:
    async def run() -> None:
        bus = InMemoryBus()
        calls: list[str] = []

        def responder(name: str):  # type: ignore[no-untyped-def]
            async def handle(msg: Message) -> None:
                calls.append(name)
                await bus.respond(msg, msg.data.upper())

            return handle

        await bus.subscribe("svc", responder("a"), queue="q")
        await bus.subscribe("svc", responder("b"), queue="q")
        assert await bus.request("svc", b"hi", 1) == b"HI"
        assert len(calls) == 1  # a queue group answers once
        with pytest.raises(NoResponders):
            await bus.request("nobody", b"", 1)

        async def silent(msg: Message) -> None:
            pass

        await bus.subscribe("slow", silent)
        with pytest.raises(RequestTimeout):
            await bus.request("slow", b"", 0.01)
        await bus.close()

    asyncio.run(run())


def test_durable_stream_replays_from_sequence() -> None:
    async def run() -> None:
        bus = InMemoryBus()
        await bus.ensure_stream("OUT", ["out.>"], 60)
        for i in range(3):
            assert await bus.publish_durable("out.g", bytes([i])) == i + 1
        got: list[tuple[int, bytes]] = []

        async def handle(msg: Message) -> None:
            got.append((msg.seq, msg.data))

        await bus.subscribe_durable("out.g", handle, start_seq=2)
        await bus.publish_durable("out.g", b"\x03")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert got == [(2, b"\x01"), (3, b"\x02"), (4, b"\x03")]
        await bus.close()

    asyncio.run(run())
