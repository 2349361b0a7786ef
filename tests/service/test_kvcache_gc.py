"""The kvcache service's store passes: expiry per class, eviction under capacity pressure, and the
cheap passes (no scan) between the full ones (index == store, snapshot)."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.bus.base import Message
from libs.protocol.codec import decode
from libs.protocol.kv_messages import KVEvents, RemovalReason, split_hashes
from services.kvcache import service as service_module
from services.kvcache.config import GIB
from services.kvcache.index import Tier
from services.kvcache.snapshot import snapshot_path
from tests.service.kvcache_harness import (
    SUBJECTS,
    Clock,
    Publisher,
    assert_index_is_store,
    config,
    hash_of,
    lookup,
    running,
    stored,
    wait_until,
)
from tests.unit.kvcache.test_store_scan import DAY, FPS, NOW, block_files, index_of, put

HOUR = 3_600.0


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


async def test_a_cheap_pass_trims_from_the_index_without_scanning(tmp_path: Path) -> None:
    clock = Clock()
    async with running(tmp_path, clock) as (bus, svc):
        worker = Publisher(bus, svc)
        agent, chat, gone = put(tmp_path, 1), put(tmp_path, 2, cls="chat"), put(tmp_path, 3, cls="chat")
        await worker.send(stored([agent]), stored([chat, gone]))
        orphan = put(tmp_path, 4, cls="chat")  # written, its event lost
        gone.unlink()  # deleted behind the index's back
        snapshot = snapshot_path(tmp_path).read_bytes()

        clock.now = NOW + 3 * DAY + 1
        report = await svc.gc_pass(full=False)
        assert [e.block_hash for e in report.expired] == [hash_of(agent)] and not agent.exists()
        assert report.num_files_scanned == 0 and not report.adopted and not report.dangling
        svc.index.check_integrity()
        assert index_of(svc.index) == {str(chat), str(gone)}  # the store is not looked at
        assert snapshot_path(tmp_path).read_bytes() == snapshot

        report = await svc.gc_pass()
        assert report.adopted == [orphan] and [e.block_hash for e in report.dangling] == [hash_of(gone)]
        assert_index_is_store(svc, tmp_path)
        assert snapshot_path(tmp_path).read_bytes() != snapshot


async def test_a_full_pass_is_due_every_reconcile_interval(tmp_path: Path) -> None:
    clock = Clock()
    async with running(tmp_path, clock, config(reconcile_interval_s=HOUR)) as (_, svc):
        assert not svc.wants_full_pass()  # the start reconciled
        clock.now += HOUR
        assert svc.wants_full_pass()
        await svc.gc_pass(full=False)
        assert svc.wants_full_pass()  # a cheap pass does not count
        await svc.gc_pass()
        assert not svc.wants_full_pass()


async def test_after_a_crash_the_reconcile_takes_recency_from_the_files(tmp_path: Path) -> None:
    """Cheap passes write no snapshot, but they do record lookups in the files' mtimes: a restart
    from an older snapshot (no clean close) gets the recency back from the files."""
    clock = Clock()
    block = put(tmp_path, 1)
    async with running(tmp_path, clock) as (bus, svc):
        await Publisher(bus, svc).send(stored([block]))
        await svc.gc_pass()  # a full pass: the snapshot holds the block, last used at NOW
        snapshot = snapshot_path(tmp_path).read_bytes()
        clock.now = NOW + HOUR
        assert await lookup(bus, [block]) == 1
        await svc.gc_pass(full=False)  # the use reaches the file's mtime, not the snapshot
        used = svc.index.get(hash_of(block))
        assert used is not None and used.last_use == NOW + HOUR
    snapshot_path(tmp_path).write_bytes(snapshot)  # as if the process died before its close

    async with running(tmp_path, clock) as (_, again):
        assert again.index.get(hash_of(block)) == used


async def test_a_resync_whose_pass_fails_stays_owed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    async with running(tmp_path, clock, config(reconcile_interval_s=HOUR)) as (bus, svc):
        failures: list[Path] = []

        def broken(index: object, root: Path, *args: object, **kwargs: object) -> None:
            failures.append(root)
            raise OSError(5, "I/O error")  # e.g. a flaky network mount

        monkeypatch.setattr(service_module, "collect_garbage", broken)
        worker = Publisher(bus, svc)
        await worker.send(seq=1)
        await worker.send(seq=3)  # a gap: the loop runs a full pass now, which fails
        await wait_until(lambda: len(failures) == 1)
        await wait_until(svc.wants_full_pass)  # still owed once the pass is over, not in an hour
        monkeypatch.undo()
        await svc.gc_pass(full=svc.wants_full_pass())
        assert svc.counters["resyncs", ""] == 1 and not svc.wants_full_pass()
