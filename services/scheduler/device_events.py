"""The G1 (device) KV events of the workers this scheduler drives, for the gateways' KV routers.

G1 lives in the scheduler (each worker's prefix cache is its core's), so the scheduler publishes
it, on ``kv.device_events``: one stream per worker, ``KVEvents(publisher_id=<scheduler>,
worker_id=<worker>)``, numbered from 1 when it starts driving the worker (the first message:
everything cached then), each next one the hashes cached and dropped since the last, in order
(``PrefixCache.take_events``), every ``kv_events_interval_s`` while anything changed. A journal
that overflowed is published as a gap, so consumers ask for a dump (``kv.dump.<scheduler>``,
answered here with the whole prefix cache as of the last seq: the events after it, replayed on
the dump, end in the same state).

The dump is one message: past about 250k cached blocks it would exceed NATS's 8 MB payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

from libs.bus.base import Bus, Message
from libs.protocol.codec import decode_or_warn, encode
from libs.protocol.kv_messages import (
    CacheTier,
    KVDump,
    KVDumpRequest,
    KVEvent,
    KVEvents,
    RemovalReason,
    join_hashes,
)
from libs.protocol.subjects import Subjects
from services.scheduler.step_loop import WorkerHandle

log = logging.getLogger(__name__)


class DeviceEvents:
    def __init__(
        self, bus: Bus, subjects: Subjects, scheduler_id: str, workers: Mapping[str, WorkerHandle]
    ) -> None:
        self.bus = bus
        self.subjects = subjects
        self.scheduler_id = scheduler_id
        self.workers = workers  # the service's own map
        self._seq: dict[str, tuple[WorkerHandle, int]] = {}  # worker id -> (its handle, last seq)

    async def publish(self, stop: asyncio.Event, interval_s: float) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            for worker_id, handle in list(self.workers.items()):
                batch = self._take(worker_id, handle)
                if batch is None:
                    continue
                try:
                    await self.bus.publish(self.subjects.kv_device_events, encode(batch))
                except Exception as exc:  # lost: consumers see the gap and ask for a dump
                    log.warning("publishing G1 events of %s failed: %r", worker_id, exc)
            for worker_id in [w for w in self._seq if w not in self.workers]:
                del self._seq[worker_id]

    def _take(self, worker_id: str, handle: WorkerHandle) -> KVEvents | None:
        """The next message of the worker's stream, or None when nothing changed."""
        cache = handle.core.block_manager.prefix_cache
        events, overflowed = cache.take_events()
        known, seq = self._seq.get(worker_id, (None, 0))
        if known is not handle:  # a core new to it: its stream starts again (seq 1) from a snapshot
            events, overflowed, seq = [(True, h) for h in cache.cached_hashes()], False, 0
        elif not events and not overflowed:
            return None
        seq += 2 if overflowed else 1  # a skipped number is a gap: consumers resync
        self._seq[worker_id] = (handle, seq)
        fingerprint = handle.core.kv_tiers.model_fingerprint
        return KVEvents(self.scheduler_id, seq, _runs(events), fingerprint, worker_id)

    async def on_dump(self, msg: Message) -> None:
        request = decode_or_warn(KVDumpRequest, msg.data, log, "G1 dump request")
        if request is None:
            return
        handle = self.workers.get(request.worker_id)
        known, seq = self._seq.get(request.worker_id, (None, 0))
        if handle is None or known is not handle:
            # Not driven here (any more), or its stream has not started: an empty dump at seq 0
            # (seq 1, when it comes, restarts the consumer's view anyway).
            dump = KVDump(self.scheduler_id, 0, b"", request.worker_id)
        else:
            hashes = handle.core.block_manager.prefix_cache.cached_hashes()
            dump = KVDump(self.scheduler_id, seq, b"", request.worker_id, join_hashes(hashes))
        await self.bus.respond(msg, encode(dump))


def _runs(events: list[tuple[bool, bytes]]) -> tuple[KVEvent, ...]:
    """Consecutive changes of one kind as one KVEvent each, in order."""
    runs: list[KVEvent] = []
    start = 0
    for i in range(1, len(events) + 1):
        if i == len(events) or events[i][0] != events[start][0]:
            stored = events[start][0]
            hashes = join_hashes([h for _, h in events[start:i]])
            # (evicted; or dropped after its sequence failed: a router does not care which)
            reason = None if stored else RemovalReason.CAPACITY
            runs.append(KVEvent(CacheTier.DEVICE, stored, hashes, reason))
            start = i
    return tuple(runs)
