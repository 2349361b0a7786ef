"""Pause, resume and expiry of the scheduler core's sequences. Pure: no nats, asyncio or torch.

A request whose client left (and may resume) leaves the worker as in a preemption at once, but
waits outside the queue (PAUSED) until ``resume`` queues it again or ``expire_paused`` (or a cancel)
aborts it. Its computed full blocks stay in the prefix cache (and are saved to the lower tiers), so
the resumed admission recomputes little; sampling depends on (seed, position) only, so it goes on
exactly as it would have.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from libs.protocol.messages import FinishReason
from services.scheduler.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from services.scheduler.worker_scheduler import WorkerScheduler


def num_paused(core: WorkerScheduler) -> int:
    return sum(s.status is SequenceStatus.PAUSED for s in core.seqs.values())


def pause(core: WorkerScheduler, request_or_seq_id: str, deadline: float) -> list[Sequence]:
    """Stop computing a request (or one choice) until ``resume``: a running sequence leaves the
    worker as in a preemption, its computed full blocks cached and queued for saving; a waiting
    one leaves the queue. ``expire_paused(now)`` aborts it once ``now >= deadline`` (the
    caller's clock). Returns the sequences now paused (a paused one gets the new deadline)."""
    paused = core._unfinished(request_or_seq_id)
    for seq in paused:
        if seq.status is SequenceStatus.RUNNING:
            core.kv_reuse.save(seq, min(seq.num_computed_tokens, seq.num_tokens))
            core._drop_from_worker(seq)
            seq.num_pauses += 1
        elif seq.status is SequenceStatus.WAITING:
            core._dequeue(seq)
        seq.status = SequenceStatus.PAUSED
        seq.pause_deadline = deadline
    return paused


def resume(core: WorkerScheduler, request_or_seq_id: str) -> list[Sequence]:
    """Queue paused sequences again, in their old place: admission recomputes them over the
    longest cached prefix of prompt and outputs. Returns the sequences resumed."""
    resumed = [s for s in core._unfinished(request_or_seq_id) if s.status is SequenceStatus.PAUSED]
    for seq in resumed:
        seq.status = SequenceStatus.WAITING
        seq.pause_deadline = 0.0
        core._enqueue(seq)
    return resumed


def expire_paused(core: WorkerScheduler, now: float) -> list[Sequence]:
    """Abort the paused sequences whose deadline has come; returns them."""
    expired = [s for s in core.seqs.values() if s.status is SequenceStatus.PAUSED and s.pause_deadline <= now]
    for seq in expired:
        core._finish(seq, FinishReason.ABORT)
    return expired


class ResumedBy:
    """Which gateway last resumed each request, for ``window_s``. A pause and a resume sent by two
    gateways are not ordered: the old gateway's pause (its reader left) may arrive after the new
    one's resume. A pause from another gateway than the resuming one is then stale."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._by: dict[str, tuple[str, float]] = {}  # request id -> (gateway id, resumed at)

    def admit(self, request_id: str, gateway_id: str, resume: bool, now: float) -> bool:
        """Whether to act on this pause (or resume, always); ``now`` on the caller's clock."""
        self._by = {r: (g, t) for r, (g, t) in self._by.items() if now - t <= self.window_s}
        if resume:
            if gateway_id:
                self._by[request_id] = (gateway_id, now)
            return True
        last = self._by.get(request_id)
        return last is None or not gateway_id or last[0] == gateway_id
