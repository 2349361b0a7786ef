"""The scheduler service's side of the lower KV tiers: G3 lookups at submit, each driven worker's
G2 view kept current from its KV events (with a dump to resync after a gap), the notices of its
finished G3 writes, and the periodic KVCacheStats of every core.

Events and dumps run inside the kv_events handler, one message at a time: while a dump is asked
for, later events wait in the subscription's queue, and those the dump already covers are ignored
when they come (``EventCursor``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from libs.bus.base import Bus, Message, NoResponders, RequestTimeout
from libs.kvstore.event_cursor import EventVerdict
from libs.protocol.codec import DecodeError, decode, decode_or_warn, encode
from libs.protocol.kv_messages import (
    CacheTier,
    KVCacheStats,
    KVDump,
    KVDumpRequest,
    KVEvents,
    KVLookup,
    KVLookupReply,
    join_hashes,
    split_hashes,
)
from libs.protocol.subjects import Subjects
from services.scheduler.config import Config
from services.scheduler.kv_tiers import to_counters
from services.scheduler.step_loop import WorkerHandle
from services.scheduler.worker_scheduler import WorkerScheduler

log = logging.getLogger(__name__)

RESYNC_BACKOFF_S = 1.0  # after a failed dump, events of that worker are dropped this long


class KVSync:
    def __init__(self, config: Config, bus: Bus, workers: Mapping[str, WorkerHandle]) -> None:
        self.config = config
        self.bus = bus
        self.subjects = Subjects(config.subject_prefix)
        self.workers = workers  # the service's own map: the workers this scheduler drives
        self._retired: Counter[tuple[str, str]] = Counter()  # counters of cores whose worker left
        self._resync_after: dict[str, float] = {}  # worker id -> no dump asked before (monotonic)
        # Hears each driven worker's finished G3 writes (worker id, block hashes): P/D handoffs
        # wait for them.
        self.on_store_written: Callable[[str, list[bytes]], None] | None = None

    # --- G3 ----------------------------------------------------------------------------------

    async def lookup(self, block_hashes: Sequence[bytes], fingerprint: str, retention_class: str = "") -> int:
        """The leading blocks of a chain stored in G3, as kvcache knows it; 0 when it does not
        answer in time (a submit never waits longer than ``kv_lookup_timeout_s`` for it)."""
        if not block_hashes:
            return 0
        query = encode(KVLookup(join_hashes(block_hashes), fingerprint, retention_class))
        try:
            data = await self.bus.request(self.subjects.kv_lookup, query, self.config.kv_lookup_timeout_s)
            reply = decode(KVLookupReply, data)
        except (NoResponders, RequestTimeout, DecodeError) as exc:
            log.debug("kv lookup of %d blocks: %r", len(block_hashes), exc)
            return 0
        except Exception as exc:  # the bus itself failed: the submit goes on without G3
            log.warning("kv lookup of %d blocks failed: %r", len(block_hashes), exc)
            return 0
        if reply.error:
            log.debug("kv lookup of %d blocks: %s", len(block_hashes), reply.error)
            return 0
        return max(0, min(reply.num_blocks, len(block_hashes)))

    # --- G2 ----------------------------------------------------------------------------------

    async def on_kv_events(self, msg: Message) -> None:
        batch = decode_or_warn(KVEvents, msg.data, log, "kv events")
        if batch is None:
            return
        handle = self.workers.get(batch.publisher_id)
        if handle is None:
            return  # a worker another scheduler drives, or one not joined yet (it resyncs then)
        self._notice_writes(batch)
        verdict = handle.kv_cursor.accept(batch.seq)
        if verdict is EventVerdict.RESYNC:
            if not await self._resync(handle):
                return
            verdict = handle.kv_cursor.accept(batch.seq)  # the dump may already hold this message
        if verdict is EventVerdict.RESTART:
            handle.core.note_host_blocks(cleared=True)
        if verdict in (EventVerdict.APPLY, EventVerdict.RESTART):
            try:
                _apply_host_events(handle.core, batch)
            except ValueError as exc:  # malformed hashes: what it holds is unknown from here on
                log.warning("bad kv events of %s: %s", batch.publisher_id, exc)
                handle.kv_cursor.synced = False
        elif verdict is EventVerdict.RESYNC:
            log.warning("kv events of %s: seq %d is past its dump", batch.publisher_id, batch.seq)

    def _notice_writes(self, batch: KVEvents) -> None:
        """Pass on the G3 writes and handoff-area writes a message reports, whatever its place in
        the G2 stream (a notice heard twice changes nothing)."""
        if self.on_store_written is None:
            return
        written: list[bytes] = []
        for event in batch.events:
            if event.tier is CacheTier.STORE and event.stored:
                with contextlib.suppress(ValueError):  # malformed: no notice (the wait is bounded)
                    written.extend(split_hashes(event.block_hashes))
        with contextlib.suppress(ValueError):
            written.extend(split_hashes(batch.handoff_keys))  # partial blocks in the handoff area
        if written:
            self.on_store_written(batch.publisher_id, written)

    async def _resync(self, handle: WorkerHandle) -> bool:
        """Replace the worker's G2 view by its dump; False (and an empty view) when it fails."""
        worker_id = handle.load.worker_id
        if time.monotonic() < self._resync_after.get(worker_id, 0.0):
            return False
        request = encode(KVDumpRequest(worker_id))
        try:
            data = await self.bus.request(
                self.subjects.kv_dump(worker_id), request, self.config.kv_dump_timeout_s
            )
            dump = decode(KVDump, data)
            block_hashes = split_hashes(dump.host_block_hashes)
        except (NoResponders, RequestTimeout, DecodeError, ValueError) as exc:
            log.warning("kv dump of %s failed: %r; its G2 counts as empty", worker_id, exc)
            handle.core.note_host_blocks(cleared=True)  # lost events: what it holds is unknown
            self._resync_after[worker_id] = time.monotonic() + RESYNC_BACKOFF_S
            return False
        if self.workers.get(worker_id) is not handle:
            return False  # dropped meanwhile
        handle.core.note_host_blocks(block_hashes, cleared=True)
        handle.kv_cursor.resynced(dump.seq)
        log.info("kv dump of %s: %d G2 blocks as of seq %d", worker_id, len(block_hashes), dump.seq)
        return True

    # --- stats -------------------------------------------------------------------------------

    def retire(self, core: WorkerScheduler) -> None:
        """A worker left: keep its core's counters, so the published ones never go down."""
        self._retired.update(core.kv_tiers.counters())

    def stats(self) -> KVCacheStats:
        totals = Counter(self._retired)
        for handle in self.workers.values():
            totals.update(handle.core.kv_tiers.counters())
        return KVCacheStats(self.config.scheduler_id, "scheduler", to_counters(dict(totals)))

    async def publish_stats(self, stop: asyncio.Event) -> None:
        subject = self.subjects.stats("scheduler", self.config.scheduler_id)
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.kv_stats_interval_s)
            if stop.is_set():
                return
            try:
                await self.bus.publish(subject, encode(self.stats()))
            except Exception as exc:  # stats are best effort; the next period tries again
                log.warning("publishing kv stats failed: %r", exc)


def _apply_host_events(core: WorkerScheduler, batch: KVEvents) -> None:
    for event in batch.events:
        core.kv_tiers.note_host_event(event)
