"""P/D handoff in the scheduler service: a request prefilled on a prefill worker moves, after its
first token, to a decode worker once the prefill worker has written the blocks it saved: the
prompt's full blocks to the shared store (G3), its partial last block to the handoff area.

The prefill worker's next plan carries those saves and drops the sequence
(``Fleet.begin_handoff``). The worker sends a KV event for each block file as soon as it is
written (or found there already), and a notice for the partial block's file: the completion
notices (``written``), heard here through ``KVSync``. One kvcache lookup at the start counts
blocks whose notice may have come before the wait began (saved by an earlier request). Once all
is written, the request is attached to a decode worker (``Fleet.end_handoff``), whose admission
plans the full blocks as G3 loads and the partial one from the handoff area, and computes only the
first output token's KV. NATS carries block hashes, keys and notices; the KV itself goes through
the store.

The wait lasts while the prefill worker lives: it gives up once the worker has been silent (no
load report, which comes every step and every --load-interval-s) for ``handoff_timeout_s`` (it
stalled, or died), or after MAX_WAIT_FACTOR x that in all (a write its store dropped, its queue
full, sends no notice). A prefill worker busy with the next prompt writes a long prompt's blocks
slowly, behind its earlier handoffs' on one writer thread; waiting costs this one request a late
second token, while giving up early makes the decode worker recompute the rest, stalling every
stream on it. On giving up, the decode worker is told only of the leading blocks written: it
computes the rest in chunks, as any prefill, and a partial block not written is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler import metrics
from services.scheduler.fleet import Fleet, Moves
from services.scheduler.kv_sync import KVSync
from services.scheduler.sequence import Sequence
from services.scheduler.step_loop import WorkerHandle

log = logging.getLogger(__name__)

CHECK_S = 0.1  # how often a wait for the notices looks whether the request is still in transit
MAX_WAIT_FACTOR = 10  # a live prefill worker's writes are waited for this x handoff_timeout_s at most


def num_leading_written(seq: Sequence, unwritten: set[bytes]) -> int:
    """The leading blocks of those ``seq`` saved that are not ``unwritten``: the decode worker loads these."""
    chain = seq.block_hashes[: seq.num_saved_blocks]
    return next((i for i, h in enumerate(chain) if h in unwritten), len(chain))


@dataclass(slots=True)
class WriteWait:
    """A handoff waiting for its prefill worker's notices."""

    worker_id: str
    unwritten: set[bytes]
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Handoffs:
    def __init__(
        self,
        fleet: Fleet,
        kv: KVSync,
        workers: dict[str, WorkerHandle],
        timeout_s: float,
        on_moves: Callable[[Moves, str], None],
    ) -> None:
        self.fleet = fleet
        self.kv = kv
        self.workers = workers
        self.timeout_s = timeout_s
        self.on_moves = on_moves  # wakes the targets and publishes what failed (with an error)
        self._active: set[str] = set()  # request ids being handed off
        self._waits: dict[str, WriteWait] = {}  # request id -> its wait for the notices

    def written(self, worker_id: str, block_hashes: list[bytes]) -> None:
        """A worker's notice: these blocks are in the store now."""
        for wait in self._waits.values():
            if wait.worker_id == worker_id and wait.unwritten:
                wait.unwritten.difference_update(block_hashes)
                if not wait.unwritten:
                    wait.done.set()

    def ready(self, seqs: list[Sequence]) -> list[str]:
        """The requests among ``seqs`` whose prefill is done (their first token is sampled) and
        whose handoff has not started; each is then counted as started."""
        ready = [
            s.request_id
            for s in seqs
            if s.handoff and s.num_output_tokens and not s.is_finished and s.request_id not in self._active
        ]
        self._active.update(ready)
        return ready

    async def hand_off(self, request_id: str) -> None:
        try:
            await self._hand_off(request_id)
        except Exception:  # one failed handoff must not take the service down
            log.exception("handoff of %s failed", request_id)
        finally:
            self._active.discard(request_id)

    async def _hand_off(self, request_id: str) -> None:
        worker_id = self.fleet.worker_of(request_id)
        source = self.workers.get(worker_id) if worker_id is not None else None
        partial = source is not None and source.load.has_handoff_area
        seqs = self.fleet.begin_handoff(request_id, partial)
        if worker_id is None or not seqs:
            return
        if source is not None:
            source.wake.set()  # its next plan saves the blocks and drops the sequence
        started = time.monotonic()
        fingerprint = source.core.kv_tiers.model_fingerprint if source is not None else ""
        head = seqs[0]
        unwritten = await self._wait_written(head, worker_id, fingerprint)
        num_listed = num_leading_written(head, unwritten)
        if source is not None and head.partial_key in unwritten:
            source.core.kv_tiers.drop_partial(head)  # not written in time: recomputed instead
        moves = self.fleet.end_handoff(request_id, num_listed)
        self.on_moves(moves, f"request {request_id} handed off by worker {worker_id}")
        if moves.moved:
            metrics.HANDOFFS.inc()
            metrics.HANDOFF_SECONDS.observe(time.monotonic() - started)
            log.info(
                "handed %s from %s to %s (%d of %d blocks in the store)",
                *(request_id, worker_id, next(iter(moves.moved)), num_listed, head.num_saved_blocks),
            )

    async def _wait_written(self, seq: Sequence, worker_id: str, fingerprint: str) -> set[bytes]:
        """What of ``seq``'s saves (its full blocks' hashes, its partial block's key) is not
        written yet, once all of it is, the request left transit (cancelled), or the prefill
        worker fell silent or the wait's cap passed (then the decode worker computes the rest)."""
        chain = seq.block_hashes[: seq.num_saved_blocks]
        if not chain and not seq.partial_key:
            return set()
        # The wait starts before the lookup: a notice meanwhile counts.
        awaited = set(chain) | ({seq.partial_key} if seq.partial_key else set())
        wait = self._waits[seq.request_id] = WriteWait(worker_id, awaited)
        started = time.monotonic()
        try:
            num_held = await self.kv.lookup(chain, fingerprint, seq.retention_class)
            self.written(worker_id, chain[:num_held])  # held already: no notice comes for those
            while not wait.done.is_set() and seq.request_id in self.fleet.in_transit:
                source = self.workers.get(worker_id)  # None once it is lost
                heard = max(started, source.last_seen) if source is not None else started
                end = min(heard + self.timeout_s, started + MAX_WAIT_FACTOR * self.timeout_s)
                left_s = end - time.monotonic()
                if left_s <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wait.done.wait(), min(CHECK_S, left_s))
        finally:
            del self._waits[seq.request_id]
        return wait.unwritten
