"""P/D handoff in the scheduler service: a request prefilled on a prefill worker moves, after its
first token, to a decode worker once the shared store (G3) lists the blocks it saved.

The prefill worker's next plan carries the saves of the prompt's full blocks and drops the
sequence (``Fleet.begin_handoff``). The kvcache index hears of each block file from that worker's
KV events once it is written; when a lookup finds them all (or ``handoff_timeout_s`` passed), the
request is attached to a decode worker (``Fleet.end_handoff``), whose admission plans them as G3
loads and computes only the partial last block and the first output token. NATS carries block
hashes and notices; the KV itself goes through the store. A block that is not there after all is
recomputed by the decode worker (a failed load), never read wrong.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from services.scheduler import metrics
from services.scheduler.fleet import Fleet, Moves
from services.scheduler.kv_sync import KVSync
from services.scheduler.sequence import Sequence
from services.scheduler.step_loop import WorkerHandle

log = logging.getLogger(__name__)

POLL_S = 0.02  # between lookups while the store is being written


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
        seqs = self.fleet.begin_handoff(request_id)
        if worker_id is None or not seqs:
            return
        source = self.workers.get(worker_id)
        if source is not None:
            source.wake.set()  # its next plan saves the blocks and drops the sequence
        started = time.monotonic()
        fingerprint = source.core.kv_tiers.model_fingerprint if source is not None else ""
        num_listed = await self._wait_stored(seqs[0], fingerprint)
        moves = self.fleet.end_handoff(request_id)
        self.on_moves(moves, f"request {request_id} handed off by worker {worker_id}")
        if moves.moved:
            metrics.HANDOFFS.inc()
            metrics.HANDOFF_SECONDS.observe(time.monotonic() - started)
            log.info(
                "handed %s from %s to %s (%d of %d blocks listed in the store)",
                *(request_id, worker_id, next(iter(moves.moved)), num_listed, seqs[0].num_saved_blocks),
            )

    async def _wait_stored(self, seq: Sequence, fingerprint: str) -> int:
        """How many of the blocks ``seq`` saved the store lists, once it lists all of them or the
        bound passed (then the decode worker recomputes what is missing)."""
        chain = seq.block_hashes[: seq.num_saved_blocks]
        deadline = time.monotonic() + self.timeout_s
        num_listed = 0
        while chain and seq.request_id in self.fleet.in_transit:
            num_listed = await self.kv.lookup(chain, fingerprint, seq.retention_class)
            if num_listed >= len(chain) or time.monotonic() > deadline:
                break
            await asyncio.sleep(POLL_S)
        return num_listed
