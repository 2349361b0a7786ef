"""Adapts bus messages to the block index of the G3 store: events in, lookups answered, the store
trimmed and reconciled on a timer, stats out.

    kv_events (KVEvents, STORE tier) -> index.insert / index.remove; a publisher's seq gap -> resync
    kv_lookup (KVLookup)             -> the longest stored, unexpired prefix; its blocks touched
    every gc_interval_s              -> expire, evict to capacity (from the index: no scan)
    every reconcile_interval_s       -> the full pass: reconcile with the store first, then snapshot
    every stats_interval_s           -> KVCacheStats on stats("kvcache", kvcache_id)

The store is the truth for G3; the index is rebuilt from it (or from a snapshot, then reconciled)
at start and after any lost event. One thread job at a time owns the index (load, GC pass: blocking
store_scan / snapshot I/O that must not see it change). While one runs, event updates and lookup
touches are queued and applied in order when it ends. Lookups still read the index meanwhile: each
dict read is atomic under the GIL, and a stale answer costs a recompute, never a wrong block
(a worker checks every block file it loads).

With no store (``kv_store_path`` "none": G3 off) it still subscribes, so schedulers get an answer
at once rather than wait out their lookup timeout: every lookup answers 0, events are ignored, and
there is no GC pass and no snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from functools import partial
from itertools import takewhile
from pathlib import Path
from typing import Final, TypeVar

from libs.bus.base import Bus, Message, Subscription
from libs.bus.membership import announce
from libs.kvstore.block_file import block_path, touch_block_file
from libs.protocol.codec import DecodeError, decode, decode_or_warn, encode
from libs.protocol.kv_messages import (
    CacheTier,
    KVCacheStats,
    KVEvent,
    KVEvents,
    KVLookup,
    KVLookupReply,
    RemovalReason,
    TierCounter,
    join_hashes,
    split_hashes,
)
from libs.protocol.member_messages import MemberInfo, MemberKind
from libs.protocol.subjects import Subjects
from services.kvcache.config import Config
from services.kvcache.index import BlockEntry, BlockIndex, Placement, Tier
from services.kvcache.snapshot import SnapshotError, load_snapshot, remove_stale_temps, write_snapshot
from services.kvcache.store_scan import GcReport, collect_garbage, rebuild_index, trim_store

log = logging.getLogger(__name__)

T = TypeVar("T")
Clock = Callable[[], float]
MAX_HASHES_PER_EVENT: Final = 16_384  # 512 KiB of hashes per message, well under NATS max_payload
EVICTION_REASONS: Final = (
    RemovalReason.EXPIRED,
    RemovalReason.CAPACITY,
    RemovalReason.CORRUPT,
    RemovalReason.MISSING,
)


def is_gap(last_seq: int | None, seq: int) -> bool:
    """Whether a publisher's message ``seq`` shows that messages were lost since ``last_seq``.

    seq 1 is a publisher's (re)start, never a gap; the first message heard from a publisher only
    sets its baseline (what it published earlier is covered by the start-up scan of the store)."""
    return last_seq is not None and seq != 1 and seq != last_seq + 1


class KVCacheService:
    def __init__(self, config: Config, bus: Bus, store_root: Path | None, clock: Clock = time.time) -> None:
        self.config = config
        self.bus = bus
        self._root = store_root  # None: G3 off
        self.clock = clock
        self.subjects = Subjects(config.subject_prefix)
        self.policy = config.retention_policy
        self.index = BlockIndex(self.policy)  # replaced by the loaded one in start()
        self.counters: Counter[tuple[str, str]] = Counter()  # (name, label) -> count since start
        self._class_names = frozenset(self.policy.classes)
        self._last_seq: dict[str, int] = {}  # publisher id -> its last KVEvents.seq
        self._out_seq = 0  # our own KVEvents (removals)
        self._touched: dict[bytes, float] = {}  # lookup hits since the last GC pass: their files' mtimes
        self._busy = False  # a thread job owns the index
        self._deferred: list[Callable[[], None]] = []
        self._job_lock = asyncio.Lock()
        self._wake = asyncio.Event()  # run a GC pass now (a resync, or stopping)
        self._resync_wanted = False
        self._last_reconcile = clock()  # start() reconciles
        self._subs: list[Subscription] = []
        self.ready = asyncio.Event()  # set once start() has loaded and reconciled the index

    @property
    def enabled(self) -> bool:
        """Whether there is a G3 store to index."""
        return self._root is not None

    @property
    def root(self) -> Path:
        """The store's directory; only asked for with G3 on."""
        assert self._root is not None, "G3 is off: there is no store"
        return self._root

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        where = f"{len(self.index)} blocks in {self._root}" if self.enabled else "G3 is off, lookups answer 0"
        log.info("kvcache %s ready: %s", self.config.kvcache_id, where)
        info = MemberInfo(MemberKind.KVCACHE, self.config.kvcache_id)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(announce(self.bus, self.subjects.members_bucket, info, stop))
            if self.enabled:
                tg.create_task(self._gc_loop(stop))
            tg.create_task(self._stats_loop(stop))
            await stop.wait()
            self._wake.set()
        await self.close()

    async def start(self) -> None:
        """Subscribe, then load the index and reconcile it with the store. Subscribing first means
        no event falls between the scan and the subscription (those during the load are queued)."""
        self._subs = [
            await self.bus.subscribe(self.subjects.kv_events, self.on_events),
            await self.bus.subscribe(self.subjects.kv_lookup, self.on_lookup),
        ]
        if not self.enabled:
            self.ready.set()  # the index stays empty: lookups answer 0
            return
        now = self.clock()
        report = await self._exclusive(lambda: self._load_job(now))
        self._last_reconcile = now
        await self._finish_pass(report)
        self.ready.set()

    async def close(self) -> None:
        """Unsubscribe and save the index, so a restart keeps the recency of the last interval."""
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs = []
        if not self.enabled:
            return
        now = self.clock()
        touched, self._touched = self._touched, {}
        try:
            await self._exclusive(lambda: self._save_job(now, touched))
        except OSError as exc:
            log.warning("could not save the index snapshot: %s", exc)

    def last_seq(self, publisher_id: str) -> int | None:
        """The seq of the last KVEvents heard from ``publisher_id`` (None: none yet)."""
        return self._last_seq.get(publisher_id)

    # --- inbound messages ------------------------------------------------------------------

    async def on_events(self, msg: Message) -> None:
        batch = decode_or_warn(KVEvents, msg.data, log, "kv events")
        if batch is None:
            return
        if batch.publisher_id == self.config.kvcache_id:
            return  # our own removals, already applied
        if not self.enabled:  # a worker with a store of its own: there is none here to index
            self._last_seq[batch.publisher_id] = batch.seq
            return
        if is_gap(self._last_seq.get(batch.publisher_id), batch.seq):
            log.warning(
                "kv events of %s jumped from seq %d to %d: resyncing with the store",
                batch.publisher_id,
                self._last_seq[batch.publisher_id],
                batch.seq,
            )
            self._resync_wanted = True
            self._wake.set()
        self._last_seq[batch.publisher_id] = batch.seq
        now = self.clock()
        for event in batch.events:
            if event.tier is not CacheTier.STORE:
                continue  # G2 (host) blocks are the scheduler's business
            try:
                hashes = split_hashes(event.block_hashes)
                stored = [(h, self._placement(batch.fingerprint, event, h)) for h in hashes if event.stored]
            except ValueError as exc:
                log.warning("bad kv event from %s: %s", batch.publisher_id, exc)
                continue
            if event.stored:
                self._mutate(partial(self._insert, event, stored, now))
            else:
                self._mutate(partial(self._remove, hashes, event.reason or RemovalReason.MISSING))

    async def on_lookup(self, msg: Message) -> None:
        try:
            lookup = decode(KVLookup, msg.data)
            hashes = split_hashes(lookup.block_hashes)
        except (DecodeError, ValueError) as exc:
            await self.bus.respond(msg, encode(KVLookupReply(0, error=str(exc))))
            return
        now = self.clock()
        hits: Iterable[BlockEntry] = self.index.lookup_longest_prefix(hashes, now)
        if lookup.fingerprint:  # hashes are per model already; this only guards a misrouted ask
            hits = takewhile(lambda e: e.placement.fingerprint == lookup.fingerprint, hits)
        hit_hashes = [e.block_hash for e in hits]
        self.counters["lookups", "G3"] += 1
        self.counters["lookup_hit_blocks", "G3"] += len(hit_hashes)
        if hit_hashes:
            cls = lookup.retention_class if lookup.retention_class in self.index.policy.classes else None
            self._mutate(lambda: self._touch(hit_hashes, now, cls))
        await self.bus.respond(msg, encode(KVLookupReply(len(hit_hashes))))

    # --- index updates (on the loop, or queued while a thread job owns the index) -------------

    def _mutate(self, update: Callable[[], None]) -> None:
        if self._busy:
            self._deferred.append(update)
        else:
            update()

    def _placement(self, fingerprint: str, event: KVEvent, block_hash: bytes) -> Placement:
        if event.num_bytes < 0:
            raise ValueError(f"num_bytes={event.num_bytes}")
        location = str(block_path(self.root, fingerprint, block_hash))  # ValueError: a bad fingerprint
        return Placement(Tier.G3, location, event.num_bytes, fingerprint)

    def _insert(self, event: KVEvent, stored: list[tuple[bytes, Placement]], now: float) -> None:
        cls: str | None = event.retention_class or None  # "": the default class
        if cls is not None and cls not in self._class_names:
            log.warning("stored blocks of unknown class %r: indexed as %r", cls, self.policy.default.name)
            cls = None
        expires_at = event.expires_at or None  # 0: now + the class's ttl
        for block_hash, placement in stored:
            self.index.insert(block_hash, placement, now, cls, expires_at=expires_at)

    def _remove(self, hashes: list[bytes], reason: RemovalReason) -> None:
        removed = sum(self.index.remove(h) is not None for h in hashes)
        self.counters["evicted_blocks", reason.name.lower()] += removed

    def _touch(self, hashes: list[bytes], now: float, retention_class: str | None = None) -> None:
        for block_hash in hashes:
            if self.index.touch(block_hash, now, retention_class) is not None:
                self._touched[block_hash] = now

    # --- thread jobs: load, GC pass, save -----------------------------------------------------

    async def _exclusive(self, job: Callable[[], T]) -> T:
        """Run ``job`` in a thread as the index's only writer; then apply what queued meanwhile."""
        async with self._job_lock:
            self._busy = True
            try:
                return await asyncio.to_thread(job)
            finally:
                self._busy = False
                deferred, self._deferred = self._deferred, []
                for update in deferred:
                    update()

    def _load_job(self, now: float) -> GcReport:
        self.root.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.root)
        try:
            index = load_snapshot(self.root, self.policy)
            log.info("index loaded from its snapshot: %d blocks", len(index))
        except SnapshotError as exc:
            log.info("no usable index snapshot (%s): scanning the store", exc)
            index, _issues = rebuild_index(self.root, self.policy)
        self.index = index  # before the queued updates apply (in _exclusive), so they land in it
        return self._reconcile_job(now)

    def _gc_job(self, now: float, touched: dict[bytes, float], full: bool) -> GcReport:
        self._touch_files(touched)
        if full:
            return self._reconcile_job(now)
        return trim_store(self.index, now, self.config.store_capacity_bytes)

    def _reconcile_job(self, now: float) -> GcReport:
        # NOTE: collect_garbage reconciles first and trims (expire, then evict to capacity) after,
        # so eviction sees the store as it is: adopted files count, vanished ones do not.
        report = collect_garbage(
            self.index, self.root, now, self.config.store_capacity_bytes, adopt_orphans=True
        )
        try:
            write_snapshot(self.index, self.root, now)
        except OSError as exc:  # a full disk: the pass itself stands; the store is the truth anyway
            log.warning("could not save the index snapshot: %s", exc)
        return report

    def _save_job(self, now: float, touched: dict[bytes, float]) -> None:
        self._touch_files(touched)
        write_snapshot(self.index, self.root, now)

    def _touch_files(self, touched: dict[bytes, float]) -> None:
        """Lookup hits into their files' mtimes: a rebuild without a snapshot keeps recency."""
        for block_hash, when in touched.items():
            entry = self.index.get(block_hash)
            if entry is not None and isinstance(entry.placement.location, str):
                with contextlib.suppress(OSError):  # gone: the reconcile drops its entry
                    touch_block_file(entry.placement.location, when)

    # --- GC and stats --------------------------------------------------------------------------

    def wants_full_pass(self) -> bool:
        """A resync was asked for (a lost event), or the last full pass is reconcile_interval_s old."""
        due = self.clock() - self._last_reconcile >= self.config.reconcile_interval_s
        return self._resync_wanted or due

    async def gc_pass(self, full: bool = True) -> GcReport:
        """Touch hit files, then expire and evict to capacity. ``full``: reconcile with the store
        first (a scan of every file: orphans adopted, entries without a file dropped) and save a
        snapshot after; the cheap passes between only trim what the index already knows."""
        resync = full and self._resync_wanted
        if full:
            self._resync_wanted = False
        now = self.clock()
        touched, self._touched = self._touched, {}
        try:
            report = await self._exclusive(lambda: self._gc_job(now, touched, full))
        except BaseException:
            self._resync_wanted = self._resync_wanted or resync  # still owed: the next pass is full
            raise
        if full:
            self._last_reconcile = now
        if resync:
            self.counters["resyncs", ""] += 1
            log.info("resynced: %d blocks adopted, %d gone", len(report.adopted), len(report.dangling))
        await self._finish_pass(report)
        return report

    async def _finish_pass(self, report: GcReport) -> None:
        removals = (
            (RemovalReason.EXPIRED, report.expired),
            (RemovalReason.CAPACITY, report.evicted),
            (RemovalReason.MISSING, report.dangling),
        )
        for reason, entries in removals:
            self.counters["evicted_blocks", reason.name.lower()] += len(entries)
        for batch in self._removal_messages(removals):
            await self.bus.publish(self.subjects.kv_events, encode(batch))
        if report.errors:
            log.warning("GC could not delete %d files, e.g. %s", len(report.errors), report.errors[0])
        log.debug(
            "GC: %d files, %d expired, %d evicted, %d adopted, %d gone, %d bad, %d temp",
            report.num_files_scanned,
            len(report.expired),
            len(report.evicted),
            len(report.adopted),
            len(report.dangling),
            len(report.deleted_bad),
            len(report.deleted_temp),
        )

    def _removal_messages(self, removals: Iterable[tuple[RemovalReason, list[BlockEntry]]]) -> list[KVEvents]:
        """Our removals as KVEvents: one message per model, each event at most
        MAX_HASHES_PER_EVENT hashes (so a big eviction still fits NATS max_payload)."""
        by_model: dict[str, list[KVEvent]] = defaultdict(list)
        for reason, entries in removals:
            hashes_by_model: dict[str, list[bytes]] = defaultdict(list)
            for entry in entries:
                hashes_by_model[entry.placement.fingerprint].append(entry.block_hash)
            for fingerprint, hashes in hashes_by_model.items():
                for i in range(0, len(hashes), MAX_HASHES_PER_EVENT):
                    chunk = join_hashes(hashes[i : i + MAX_HASHES_PER_EVENT])
                    by_model[fingerprint].append(KVEvent(CacheTier.STORE, False, chunk, reason))
        messages: list[KVEvents] = []
        for fingerprint, events in by_model.items():
            for event in events:
                self._out_seq += 1
                messages.append(KVEvents(self.config.kvcache_id, self._out_seq, (event,), fingerprint))
        return messages

    def stats(self) -> KVCacheStats:
        """Gauges of the store as the index sees it, and counters since start."""
        totals = self.index.totals()
        counters: list[TierCounter] = []
        for name, by_class, total in (
            ("stored_blocks", totals.num_blocks_by_class, totals.num_blocks_by_tier.get(Tier.G3, 0)),
            ("stored_bytes", totals.num_bytes_by_class, totals.num_bytes_by_tier.get(Tier.G3, 0)),
        ):
            counters += [TierCounter(name, cls, by_class.get(cls, 0)) for cls in sorted(self._class_names)]
            counters.append(TierCounter(name, "total", total))
        for reason in EVICTION_REASONS:
            label = reason.name.lower()
            counters.append(TierCounter("evicted_blocks", label, self.counters["evicted_blocks", label]))
        for name, label in (("lookups", "G3"), ("lookup_hit_blocks", "G3"), ("resyncs", "")):
            counters.append(TierCounter(name, label, self.counters[name, label]))
        return KVCacheStats(self.config.kvcache_id, "kvcache", tuple(counters))

    async def publish_stats(self) -> None:
        subject = self.subjects.stats("kvcache", self.config.kvcache_id)
        await self.bus.publish(subject, encode(self.stats()))

    async def _gc_loop(self, stop: asyncio.Event) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.gc_interval_s)
            self._wake.clear()
            if stop.is_set():
                return
            try:
                await self.gc_pass(full=self.wants_full_pass())
            except Exception:  # a full disk or a flaky mount must not end the service
                log.exception("GC pass failed")

    async def _stats_loop(self, stop: asyncio.Event) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.stats_interval_s)
            if stop.is_set():
                return
            try:
                await self.publish_stats()
            except Exception as exc:  # a NATS outage: the next period tries again
                log.warning("stats publish failed: %s", exc)
