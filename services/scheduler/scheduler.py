"""Scheduler core for one worker: queues, admission and step plans. Pure: no nats, asyncio or torch.

One step = ``schedule()`` -> the worker runs the plan -> ``postprocess(plan, sampled)``. A plan
prefills newly admitted sequences whole and decodes one token for every running one (chunked
prefill and paged KV come with the engine core). Sequences that finished or were aborted since the
last plan are named in ``finished_seq_ids`` so the worker drops their state; a plan with only
those is still sent, so a cancel frees the worker even when nothing else runs.
"""

from __future__ import annotations

import heapq
import itertools

from libs.protocol.codec import pack_tokens
from libs.protocol.errors import QueueFull
from libs.protocol.messages import FinishReason, NewSequence, SchedulerOutput
from services.scheduler.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(
        self, max_num_seqs: int, max_model_len: int, max_num_waiting: int, scheduler_id: str = ""
    ) -> None:
        self.scheduler_id = scheduler_id
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_waiting = max_num_waiting
        self.seqs: dict[str, Sequence] = {}  # every unfinished sequence, waiting or running
        self._waiting: list[tuple[int, int, str]] = []  # heap of (priority, arrival, seq_id)
        self._running: list[str] = []  # in admission order
        self._finished_since_plan: list[str] = []  # the worker must drop these
        self._arrivals = itertools.count()
        self._step_ids = itertools.count(1)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._finished_since_plan)

    def add(self, seq: Sequence) -> None:
        if len(self._waiting) >= self.max_num_waiting:
            raise QueueFull(len(self._waiting), self.max_num_waiting)
        seq.arrival = next(self._arrivals)
        self.seqs[seq.seq_id] = seq
        heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq.seq_id))

    def abort(self, seq_id: str) -> Sequence | None:
        """Finish ``seq_id`` as aborted; returns it, or None if it is unknown or already done."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            return None
        self._finish(seq, FinishReason.ABORT)
        return seq

    def schedule(self) -> SchedulerOutput:
        new_seqs: list[NewSequence] = []
        while self._waiting and len(self._running) < self.max_num_seqs:
            _, _, seq_id = heapq.heappop(self._waiting)
            seq = self.seqs[seq_id]
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq_id)
            new_seqs.append(NewSequence(seq_id, pack_tokens(seq.prompt_token_ids), seq.sampling_params))
        new_ids = {s.seq_id for s in new_seqs}
        plan = SchedulerOutput(
            step_id=next(self._step_ids),
            new_seqs=tuple(new_seqs),
            decode_seq_ids=tuple(s for s in self._running if s not in new_ids),
            finished_seq_ids=tuple(self._finished_since_plan),
            scheduler_id=self.scheduler_id,
        )
        self._finished_since_plan = []
        return plan

    def postprocess(self, seq_ids: tuple[str, ...], sampled: list[int]) -> list[Sequence]:
        """Append each sampled token; returns the sequences that changed (finished ones included)."""
        changed: list[Sequence] = []
        for seq_id, token_id in zip(seq_ids, sampled, strict=True):
            seq = self.seqs.get(seq_id)
            if seq is None:
                continue  # aborted while the step ran; its token is dropped
            seq.output_token_ids.append(token_id)
            reason = self._check_stop(seq, token_id)
            if reason is not None:
                self._finish(seq, reason)
            changed.append(seq)
        return changed

    def fail(self, seq_ids: tuple[str, ...]) -> list[Sequence]:
        """The worker dropped these (it already freed their state)."""
        failed = [self.seqs[s] for s in seq_ids if s in self.seqs]
        for seq in failed:
            self._finish(seq, FinishReason.ERROR)
        dropped = set(seq_ids)
        self._finished_since_plan = [s for s in self._finished_since_plan if s not in dropped]
        return failed

    def fail_all(self) -> list[Sequence]:
        """The worker is gone: finish every sequence with an error (nothing to tell the worker)."""
        failed = list(self.seqs.values())
        for seq in failed:
            self._finish(seq, FinishReason.ERROR)
        self._finished_since_plan = []
        return failed

    def _check_stop(self, seq: Sequence, token_id: int) -> FinishReason | None:
        if token_id in seq.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= seq.sampling_params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq.seq_id)
            self._finished_since_plan.append(seq.seq_id)
        elif seq.status is SequenceStatus.WAITING:
            self._waiting.remove((seq.priority, seq.arrival, seq.seq_id))
            heapq.heapify(self._waiting)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.seqs[seq.seq_id]

    def check_integrity(self) -> None:
        running = [s for s in self.seqs.values() if s.status is SequenceStatus.RUNNING]
        assert len(running) == len(self._running) <= self.max_num_seqs
        assert set(self._running) == {s.seq_id for s in running}
        waiting = {s.seq_id for s in self.seqs.values() if s.status is SequenceStatus.WAITING}
        assert waiting == {sid for _, _, sid in self._waiting}
        assert len(waiting) + len(running) == len(self.seqs)
        assert not set(self._finished_since_plan) & set(self.seqs)
