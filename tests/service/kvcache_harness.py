"""The kvcache service's test harness: the in-memory bus, a real store directory, a clock the
tests move, and a ``Publisher`` standing in for a worker's ``kv_events``.

Block files are written as a worker would (``put`` from the store-scan tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from libs.bus.memory import InMemoryBus
from libs.kvstore.block_file import BLOCK_FILE_SUFFIX, read_header
from libs.kvstore.block_hash import block_hash_from_hex
from libs.protocol.codec import decode, encode
from libs.protocol.kv_messages import CacheTier, KVEvent, KVEvents, KVLookup, KVLookupReply, join_hashes
from libs.protocol.subjects import Subjects
from services.kvcache.config import Config
from services.kvcache.service import KVCacheService
from tests.unit.kvcache.test_store_scan import FPS, NOW, block_files, index_of

SUBJECTS = Subjects()
HOUR = 3_600.0


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def wait_until(cond: Callable[[], bool]) -> None:
    """Let the bus deliver until ``cond`` holds (the bound only stops a broken test hanging)."""
    for _ in range(2_000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


def config(**overrides: object) -> Config:
    # Timers far away: the tests run GC passes and stats themselves.
    base = Config(kvcache_id="kv1", gc_interval_s=1e6, stats_interval_s=1e6)
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def running(
    root: Path | None, clock: Clock, cfg: Config | None = None, bus: InMemoryBus | None = None
) -> AsyncIterator[tuple[InMemoryBus, KVCacheService]]:
    bus = bus or InMemoryBus()
    svc = KVCacheService(cfg or config(), bus, root, clock)
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    await asyncio.wait_for(svc.ready.wait(), 10)
    svc.index.check_integrity()
    try:
        yield bus, svc
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def stored(paths: list[Path]) -> KVEvent:
    """The STORE event a worker publishes after writing these files (one class, one size)."""
    metas = [read_header(p).meta for p in paths]
    sizes = {p.stat().st_size for p in paths}
    classes = {m.retention_class for m in metas}
    assert len(sizes) == 1 and len(classes) == 1
    return KVEvent(
        CacheTier.STORE,
        True,
        join_hashes([m.block_hash for m in metas]),
        retention_class=classes.pop(),
        expires_at=metas[0].expires_at,
        num_bytes=sizes.pop(),
    )


def hash_of(path: Path) -> bytes:
    """The hash a block file is named by (the file may be gone)."""
    return block_hash_from_hex(path.name.removesuffix(BLOCK_FILE_SUFFIX))


class Publisher:
    """A worker's kv_events: seq +1 per message unless told otherwise."""

    def __init__(self, bus: InMemoryBus, svc: KVCacheService, publisher_id: str = "w1") -> None:
        self.bus, self.svc, self.publisher_id, self.seq = bus, svc, publisher_id, 0

    async def send(self, *events: KVEvent, seq: int | None = None, fingerprint: str = FPS[0]) -> None:
        self.seq = self.seq + 1 if seq is None else seq
        batch = KVEvents(self.publisher_id, self.seq, events, fingerprint)
        await self.bus.publish(SUBJECTS.kv_events, encode(batch))
        # One subscription handles messages in order: once this one is in, so is every earlier one.
        await wait_until(lambda: self.svc.last_seq(self.publisher_id) == self.seq)


async def lookup(bus: InMemoryBus, paths: list[Path], fingerprint: str = FPS[0], cls: str = "") -> int:
    data = encode(KVLookup(join_hashes([hash_of(p) for p in paths]), fingerprint, cls))
    reply = decode(KVLookupReply, await bus.request(SUBJECTS.kv_lookup, data, 5))
    assert reply.error == ""
    return reply.num_blocks


def assert_index_is_store(svc: KVCacheService, root: Path) -> None:
    svc.index.check_integrity()
    assert index_of(svc.index) == block_files(root)
