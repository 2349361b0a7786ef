"""The kvcache service on the in-memory bus over a real store directory (tmp_path), with a clock
the tests move (kvcache_harness.py): events -> index -> lookups, resyncs, restarts, stats. Expiry
and eviction: test_kvcache_gc.py.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from libs.bus.base import Message
from libs.kvstore.retention import RetentionPolicy
from libs.protocol.codec import decode, encode
from libs.protocol.kv_messages import (
    CacheTier,
    KVCacheStats,
    KVEvent,
    KVLookup,
    KVLookupReply,
    RemovalReason,
    join_hashes,
)
from libs.runtime.settings import kv_store_root
from services.kvcache import main as kvcache_main
from services.kvcache import service as service_module
from services.kvcache.config import Config
from services.kvcache.index import BlockEntry, BlockIndex, Tier
from services.kvcache.service import KVCacheService, is_gap
from services.kvcache.snapshot import snapshot_path
from services.kvcache.store_scan import ScanIssue
from tests.service.kvcache_harness import (
    SUBJECTS,
    Clock,
    Publisher,
    assert_index_is_store,
    hash_of,
    lookup,
    running,
    stored,
    wait_until,
)
from tests.unit.kvcache.test_store_scan import DAY, FPS, NOW, put

HOUR = 3_600.0


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
    monkeypatch.setattr(kvcache_main, "run_service", lambda start, *_: asyncio.run(start(asyncio.Event())))
    kvcache_main.main(argparse.Namespace(kv_store_path=flag, cache_dir=str(tmp_path)))
    want = {"": tmp_path / "kv-store", "~/kv": Path.home() / "kv"}.get(flag)  # "none": G3 off
    assert roots == [want] == [kv_store_root(flag, str(tmp_path))]
