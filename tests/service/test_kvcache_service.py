"""The kvcache service on the in-memory bus over a real store directory (tmp_path), with a clock
the tests move: events -> index -> lookups, resyncs, expiry and eviction, restarts, stats.

Block files are written as a worker would (``put`` from the store-scan tests); a ``Publisher``
stands in for the worker's ``kv_events``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from deepinfer.settings import kv_store_root
from libs.bus.base import Message
from libs.bus.memory import InMemoryBus
from libs.kvstore.block_file import BLOCK_FILE_SUFFIX, read_header
from libs.kvstore.block_hash import block_hash_from_hex
from libs.kvstore.retention import RetentionPolicy
from libs.protocol.codec import decode, encode
from libs.protocol.kv_messages import (
    CacheTier,
    KVCacheStats,
    KVEvent,
    KVEvents,
    KVLookup,
    KVLookupReply,
    RemovalReason,
    join_hashes,
    split_hashes,
)
from libs.protocol.subjects import Subjects
from services.kvcache import main as kvcache_main
from services.kvcache import service as service_module
from services.kvcache.config import GIB, Config
from services.kvcache.index import BlockEntry, BlockIndex, Tier
from services.kvcache.service import KVCacheService, is_gap
from services.kvcache.snapshot import snapshot_path
from services.kvcache.store_scan import ScanIssue
from tests.unit.kvcache.test_store_scan import DAY, FPS, NOW, block_files, index_of, put

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


@pytest.mark.parametrize(
    ("last", "seq", "gap"),
    [(None, 5, False), (4, 5, False), (4, 6, True), (4, 1, False), (1, 1, False), (7, 3, True), (7, 7, True)],
)
def test_is_gap(last: int | None, seq: int, gap: bool) -> None:
    assert is_gap(last, seq) is gap


async def test_events_index_blocks_and_lookups_answer_the_longest_prefix(tmp_path: Path) -> None:
    clock = Clock()
    async with running(tmp_path, clock) as (bus, svc):
        worker = Publisher(bus, svc)
        agent = [put(tmp_path, i) for i in range(4)]
        chat = put(tmp_path, 10, cls="chat")
        await worker.send(stored([agent[0], agent[1], agent[3]]), stored([chat]))
        svc.index.check_integrity()
        assert await lookup(bus, agent) == 2  # stops at the first block not stored
        assert await lookup(bus, [agent[3], agent[0], agent[2], agent[1]]) == 2
        assert await lookup(bus, agent[2:]) == 0
        assert await lookup(bus, agent, fingerprint=FPS[1]) == 0  # not that model's blocks
        bad = await bus.request(SUBJECTS.kv_lookup, encode(KVLookup(b"short")), 5)
        assert decode(KVLookupReply, bad).error

        clock.now += HOUR
        assert await lookup(bus, agent[:1]) == 1
        entry = svc.index.get(hash_of(agent[0]))
        assert entry is not None and entry.last_use == clock.now  # a hit is a use
        assert await lookup(bus, agent[:1], cls="chat") == 1  # a chat request reuses it: 7 days now
        entry = svc.index.get(hash_of(agent[0]))
        assert entry is not None and entry.retention_class == "chat"
        assert entry.expires_at == clock.now + 7 * DAY
        assert await lookup(bus, agent[:1], cls="nonesuch") == 1  # a class unknown here: kept as is

        gone = KVEvent(CacheTier.STORE, False, join_hashes([hash_of(agent[1])]), RemovalReason.CORRUPT)
        host = KVEvent(CacheTier.HOST, False, join_hashes([hash_of(agent[0])]), RemovalReason.CAPACITY)
        await worker.send(gone, host)  # the HOST event is the scheduler's business
        svc.index.check_integrity()
        assert await lookup(bus, agent) == 1
        assert svc.counters["evicted_blocks", "corrupt"] == 1

        clock.now = NOW + 3 * DAY + 2 * HOUR  # agent blocks (3 d) expired, chat (7 d) not: no GC needed
        assert await lookup(bus, agent) == 1  # agent[0], raised to chat by its reuse
        assert await lookup(bus, [chat]) == 1
        svc.index.check_integrity()


async def test_a_seq_gap_resyncs_with_the_store(tmp_path: Path) -> None:
    clock = Clock()
    async with running(tmp_path, clock) as (bus, svc):
        worker = Publisher(bus, svc)
        kept, vanished = put(tmp_path, 1), put(tmp_path, 2)
        await worker.send(stored([kept, vanished]))
        await worker.send(seq=1)  # the worker restarted: not a gap
        vanished.unlink()  # e.g. its removal event was lost
        unannounced = put(tmp_path, 3)  # its stored event was lost
        announced = put(tmp_path, 4)
        await worker.send(stored([announced]), seq=3)  # seq 2 never arrived
        await wait_until(lambda: svc.counters["resyncs", ""] == 1)
        assert hash_of(kept) in svc.index and hash_of(announced) in svc.index
        assert hash_of(vanished) not in svc.index
        assert hash_of(unannounced) in svc.index
        assert_index_is_store(svc, tmp_path)
        assert await lookup(bus, [kept, unannounced, announced]) == 3

        other = Publisher(bus, svc, "w2")
        await other.send(seq=40)  # first heard of: a baseline, not a gap
        await svc.gc_pass()  # a pass counts a resync if one was asked for
        assert svc.counters["resyncs", ""] == 1


async def test_gc_expires_blocks_per_class_and_deletes_their_files(tmp_path: Path) -> None:
    clock = Clock()
    removals: list[KVEvents] = []

    async def collect(msg: Message) -> None:
        batch = decode(KVEvents, msg.data)
        if batch.publisher_id == "kv1":
            removals.append(batch)

    async with running(tmp_path, clock) as (bus, svc):
        await bus.subscribe(SUBJECTS.kv_events, collect)
        worker = Publisher(bus, svc)
        agent = [put(tmp_path, i) for i in range(2)]
        chat = put(tmp_path, 10, cls="chat")
        await worker.send(stored(agent), stored([chat]))

        clock.now = NOW + 3 * DAY + 1
        report = await svc.gc_pass()
        assert {e.block_hash for e in report.expired} == {hash_of(p) for p in agent}
        assert not any(p.exists() for p in agent) and chat.exists()
        assert_index_is_store(svc, tmp_path)
        await wait_until(lambda: len(removals) == 1)
        (event,) = removals[0].events
        assert event.reason is RemovalReason.EXPIRED and removals[0].fingerprint == FPS[0]
        assert set(split_hashes(event.block_hashes)) == {hash_of(p) for p in agent}

        clock.now = NOW + 7 * DAY + 1
        report = await svc.gc_pass()
        assert [e.block_hash for e in report.expired] == [hash_of(chat)] and not chat.exists()
        assert_index_is_store(svc, tmp_path)
        await wait_until(lambda: len(removals) == 2)
        assert removals[1].seq == removals[0].seq + 1
        await worker.send()  # handled after our own removal events, which must not count twice
        assert svc.counters["evicted_blocks", "expired"] == 3


async def test_capacity_evicts_expired_then_lower_class_then_least_recently_used(tmp_path: Path) -> None:
    clock = Clock()
    size = put(tmp_path / "probe", 0).stat().st_size
    cfg = config(store_capacity_gb=(2 * size + 0.5) / GIB)  # room for two blocks
    async with running(tmp_path / "store", clock, cfg) as (bus, svc):
        root = tmp_path / "store"
        worker = Publisher(bus, svc)
        expired_chat = put(root, 1, cls="chat", age=8 * DAY)  # a high class, but expired
        agent_a, agent_b = put(root, 2), put(root, 3)
        chat_a, chat_b = put(root, 4, cls="chat"), put(root, 5, cls="chat")
        await worker.send(stored([expired_chat]))
        await worker.send(stored([agent_a]), stored([chat_a]))
        clock.now += 60
        await worker.send(stored([agent_b]), stored([chat_b]))
        clock.now += 60
        assert await lookup(bus, [agent_a]) == 1  # now agent_b is the least recently used

        report = await svc.gc_pass()
        assert [e.block_hash for e in report.expired] == [hash_of(expired_chat)]
        assert [e.block_hash for e in report.evicted] == [hash_of(agent_b), hash_of(agent_a)]
        assert block_files(root) == {str(chat_a), str(chat_b)}
        assert_index_is_store(svc, root)
        assert svc.index.num_bytes(Tier.G3) <= cfg.store_capacity_bytes

        clock.now += 60
        await worker.send(stored([put(root, 6, cls="chat")]))  # a third chat block: the least recent goes
        report = await svc.gc_pass()
        assert [e.block_hash for e in report.evicted] == [hash_of(chat_a)]
        assert_index_is_store(svc, root)


def g3_entries(svc: KVCacheService) -> list[BlockEntry]:
    return sorted(svc.index.entries(Tier.G3), key=lambda e: e.block_hash)


def spy_on_rebuilds(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The roots the service rebuilds its index of by scanning (rather than from a snapshot)."""
    scans: list[Path] = []
    real_rebuild = service_module.rebuild_index

    def rebuild(root: Path, policy: RetentionPolicy) -> tuple[BlockIndex, list[ScanIssue]]:
        scans.append(root)
        return real_rebuild(root, policy)

    monkeypatch.setattr(service_module, "rebuild_index", rebuild)
    return scans


async def test_a_restart_loads_the_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    async with running(tmp_path, clock) as (bus, svc):
        worker = Publisher(bus, svc)
        blocks = [put(tmp_path, i, age=HOUR) for i in range(3)]
        await worker.send(stored(blocks))
        clock.now += 600
        assert await lookup(bus, blocks[:1]) == 1
        before = g3_entries(svc)
    assert snapshot_path(tmp_path).exists()  # written on stop

    scans = spy_on_rebuilds(monkeypatch)
    clock.now += 60
    async with running(tmp_path, clock) as (_, svc):
        assert scans == []
        assert g3_entries(svc) == before  # same entries, same last use, same expiry
        assert_index_is_store(svc, tmp_path)

    blocks[2].unlink()  # gone while the service was down
    late = put(tmp_path, 7)  # stored while it was down
    async with running(tmp_path, clock) as (_, svc):
        assert scans == []
        assert {e.block_hash for e in g3_entries(svc)} == {hash_of(p) for p in (blocks[0], blocks[1], late)}
        assert_index_is_store(svc, tmp_path)


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
async def test_a_bad_snapshot_is_rebuilt_by_scanning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    clock = Clock()
    async with running(tmp_path, clock) as (bus, svc):
        worker = Publisher(bus, svc)
        blocks = [put(tmp_path, i, cls="chat", age=HOUR) for i in range(3)]
        await worker.send(stored(blocks))
        clock.now += 600
        assert await lookup(bus, blocks[1:2]) == 1
        used_at = clock.now
    path = snapshot_path(tmp_path)
    if damage == "corrupt":
        path.write_bytes(path.read_bytes()[:-7])
    else:
        path.unlink()

    scans = spy_on_rebuilds(monkeypatch)
    async with running(tmp_path, clock) as (bus, svc):
        assert scans == [tmp_path]
        assert {e.block_hash for e in g3_entries(svc)} == {hash_of(p) for p in blocks}
        entry = svc.index.get(hash_of(blocks[1]))
        assert entry is not None and entry.last_use == used_at  # the hit reached the file's mtime
        assert entry.retention_class == "chat"
        assert await lookup(bus, blocks) == 3
        assert_index_is_store(svc, tmp_path)


async def test_stats_report_the_store_and_the_counters(tmp_path: Path) -> None:
    clock = Clock()
    stats: list[KVCacheStats] = []

    async def collect(msg: Message) -> None:
        stats.append(decode(KVCacheStats, msg.data))

    async with running(tmp_path, clock) as (bus, svc):
        await bus.subscribe(SUBJECTS.stats("kvcache", "kv1"), collect)
        worker = Publisher(bus, svc)
        agent = [put(tmp_path, i) for i in range(3)]
        chat = [put(tmp_path, 10 + i, cls="chat") for i in range(2)]
        size = chat[0].stat().st_size  # the class name is in the header: sizes differ by class
        await worker.send(stored(agent), stored(chat))
        agent[2].unlink()
        await worker.send(
            KVEvent(CacheTier.STORE, False, join_hashes([hash_of(agent[2])]), RemovalReason.MISSING)
        )
        assert await lookup(bus, agent) == 2
        assert await lookup(bus, chat[::-1]) == 2
        assert await lookup(bus, agent[2:]) == 0
        clock.now = NOW + 3 * DAY + 1
        await svc.gc_pass()
        await worker.send(seq=9)  # a gap: one resync
        await wait_until(lambda: svc.counters["resyncs", ""] == 1)
        await svc.publish_stats()
        await wait_until(lambda: len(stats) == 1)

    (got,) = stats
    assert got.publisher_id == "kv1" and got.kind == "kvcache"
    assert {(c.name, c.label): c.value for c in got.counters} == {
        ("stored_blocks", "agent"): 0,
        ("stored_blocks", "chat"): 2,
        ("stored_blocks", "total"): 2,
        ("stored_bytes", "agent"): 0,
        ("stored_bytes", "chat"): 2 * size,
        ("stored_bytes", "total"): 2 * size,
        ("evicted_blocks", "expired"): 2,
        ("evicted_blocks", "capacity"): 0,
        ("evicted_blocks", "corrupt"): 0,
        ("evicted_blocks", "missing"): 1,
        ("lookups", "G3"): 3,
        ("lookup_hit_blocks", "G3"): 4,
        ("resyncs", ""): 1,
    }


async def test_with_g3_off_lookups_answer_0_and_no_store_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger=service_module.__name__)
    monkeypatch.chdir(tmp_path)  # the old bug: a directory named ./none, scanned and trimmed
    blocks = [put(tmp_path / "elsewhere", i) for i in range(2)]  # a worker with a store of its own
    async with running(None, Clock()) as (bus, svc):
        await Publisher(bus, svc).send(stored(blocks))
        assert await lookup(bus, blocks) == 0 and len(svc.index) == 0
        assert svc.counters["lookups", "G3"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["elsewhere"]  # no store, no snapshot
    assert caplog.text.count("G3 is off") == 1


@pytest.mark.parametrize("flag", ["none", " None ", "~/kv", ""])
def test_main_reads_kv_store_path_as_the_worker_does(
    flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    roots: list[Path | None] = []

    async def serve(cfg: Config, store_root: Path | None, stop: asyncio.Event) -> None:
        roots.append(store_root)

    monkeypatch.setattr(kvcache_main, "serve", serve)
    monkeypatch.setattr(kvcache_main, "setup_logging", lambda *args: None)
    monkeypatch.setattr(kvcache_main, "run_service", lambda start: asyncio.run(start(asyncio.Event())))
    kvcache_main.main(argparse.Namespace(kv_store_path=flag, cache_dir=str(tmp_path)))
    want = {"": tmp_path / "kv-store", "~/kv": Path.home() / "kv"}.get(flag)  # "none": G3 off
    assert roots == [want] == [kv_store_root(flag, str(tmp_path))]
