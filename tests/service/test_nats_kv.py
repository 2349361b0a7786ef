"""The NATS bus's key-value listing against a real nats-server: complete while keys are written.

``kv_items`` feeds every liveness decision (``/health``, ``deepinfer health``, the reaping of
dead workers), so a listing that drops a live key makes a healthy stack look dead.
"""

from __future__ import annotations

import asyncio

from libs.bus.nats_bus import NatsBus
from libs.bus.nats_server import EmbeddedNatsServer

BUCKET = "members-test"
NUM_WRITERS = 4
NUM_READS = 300


async def _write_forever(url: str, key: str, stop: asyncio.Event) -> None:
    bus = await NatsBus.connect(url, key)
    await bus.ensure_kv(BUCKET, 6.0)
    n = 0
    while not stop.is_set():
        n += 1
        await bus.kv_put(BUCKET, key, b"%d" % n)
        await asyncio.sleep(0.01)
    await bus.close()


async def test_listing_holds_every_key_while_they_are_rewritten_and_no_purged_one() -> None:
    with EmbeddedNatsServer() as server:
        reader = await NatsBus.connect(server.url, "reader")
        await reader.ensure_kv(BUCKET, 6.0)
        assert await reader.kv_items(BUCKET) == {}
        await reader.kv_put(BUCKET, "gone", b"x")
        await reader.kv_delete(BUCKET, "gone")
        stop = asyncio.Event()
        keys = {f"worker.w{i}" for i in range(NUM_WRITERS)}
        writers = [asyncio.create_task(_write_forever(server.url, k, stop)) for k in sorted(keys)]
        try:
            while set(await reader.kv_items(BUCKET)) != keys:
                await asyncio.sleep(0.05)
            short = []
            for _ in range(NUM_READS):
                listed = set(await reader.kv_items(BUCKET))
                if listed != keys:
                    short.append(sorted(listed))
            assert short == []  # the old consumer-based listing dropped keys here now and then
        finally:
            stop.set()
            await asyncio.gather(*writers)
            await reader.close()
