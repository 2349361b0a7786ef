"""Scheduler core for one worker: queues, KV blocks, preemption and step plans. Pure: no nats,
asyncio or torch.

One step = ``schedule()`` -> the worker runs the plan -> ``postprocess(result)``. Each plan packs
work under a token budget (``max_num_batched_tokens``) and ``max_num_seqs``, in this order:
1. one token for every running sequence that is decoding;
2. the next chunk of every running sequence still in prefill (chunked prefill);
3. newly admitted (or resumed) sequences from the waiting queue, by priority, fairly between
   tenants (fair_queue.py), then arrival.
When KV blocks run out, the lowest-priority, latest-arrived running sequence that is not yet in
the plan is preempted by recompute: its blocks are freed, the worker drops it, and it waits to be
prefilled again over its prompt and the tokens it has already produced. No admission happens in a
step that preempted.

Pause: a request whose client left (and may resume) leaves the worker the same way at once, but
waits outside the queue (PAUSED) until resumed or expired (see pausing).

Overlap scheduling: plans may be made before earlier results arrive. A plan counts the tokens its
predecessors will sample (``Sequence.num_pending_tokens``) so a decode can be scheduled whose
input token only the worker knows yet.

Prefix caching (G1, see kv_reuse): a sequence admitted from the waiting queue starts with the
cached blocks of the longest prefix of its known tokens (block hashes salted with its tenant) and
computes only the rest, always including its last token, whose logits it samples from. Full
blocks enter the cache once the plans already made compute them, and stay cached after their
owners finish or are preempted, until allocation evicts them (least recently used first).

Lower tiers (G2 host memory, G3 shared store; ``TierPlanner``): admission extends a G1 hit with the
blocks that follow in G2 or G3, which the worker loads before the forward; store points queue
saves of full blocks that ride in the next plan (see kv_tiers on why that is safe).

NOTE: why reuse is safe with two plans in flight. The worker runs plans one after another in the
order they are made. A block's hash is published (``cache_blocks``) only for tokens whose KV a plan
made *before* the current one computes, so a plan that hits it reads KV its predecessors wrote. A
block is handed out again (free or evicted) only when no sequence holds it; the sequences that
held it were freed before this plan and are in no plan from now on, so every plan that reads or
writes its old content runs before the plan that overwrites it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

from libs.protocol.errors import QueueFull
from libs.protocol.member_messages import StepSample
from libs.protocol.messages import FinishReason, SchedulerOutput
from services.scheduler import admission, integrity, pausing, step_results
from services.scheduler.block_manager import BlockManager
from services.scheduler.fair_queue import FairQueue
from services.scheduler.kv_reuse import KVReuse
from services.scheduler.kv_tiers import TierPlanner
from services.scheduler.limits import Limits as Limits  # re-exported: callers import it from here
from services.scheduler.plan import Plan
from services.scheduler.prefix_cache import BlockHasher, PrefixCacheStats
from services.scheduler.sequence import Sequence, SequenceStatus
from services.scheduler.spec_policy import VerifyPolicy
from services.scheduler.speculation import Speculator


class WorkerScheduler:
    def __init__(self, limits: Limits, scheduler_id: str = "", model_fingerprint: str = "") -> None:
        self.limits = limits
        self.scheduler_id = scheduler_id
        self.block_manager = BlockManager(limits.num_blocks, limits.block_size)
        self._hasher = BlockHasher(limits.block_size, model_fingerprint)
        self.kv_tiers = TierPlanner(limits, self._hasher, self.block_manager.prefix_cache)
        self.kv_reuse = KVReuse(limits, self.block_manager, self._hasher, self.kv_tiers)
        self.seqs: dict[str, Sequence] = {}  # every unfinished sequence: waiting, running or paused
        self._waiting = FairQueue()  # by priority, fair between tenants, then arrival
        self._running: list[Sequence] = []  # sorted by order
        self._finished_since_plan: list[str] = []  # the worker must drop these
        self._request_seqs: dict[str, list[str]] = {}  # request id -> its sequences' ids
        self._watermark_blocks = int(limits.watermark * limits.num_blocks)
        self._arrivals = itertools.count()
        self._front_arrivals = itertools.count(-1, -1)  # moved sequences queue ahead (see moving)
        self._step_ids = itertools.count(1)
        self.num_preemptions = 0  # since start: a count for metrics
        policy = VerifyPolicy(limits.speculative_policy)
        self.speculator = Speculator(limits.speculative_method, policy=policy)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_paused(self) -> int:
        return pausing.num_paused(self)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.block_manager.prefix_cache.stats

    def has_work(self) -> bool:
        busy = self._waiting or self._running or self._finished_since_plan
        return bool(busy) or self.kv_tiers.has_pending_saves

    def note_host_blocks(
        self, stored: Iterable[bytes] = (), removed: Iterable[bytes] = (), cleared: bool = False
    ) -> None:
        """The worker's G2 (host memory) content changed; see ``TierPlanner.note_host_blocks``."""
        self.kv_tiers.note_host_blocks(stored, removed, cleared)

    def add(self, seq: Sequence, outputs: list[list[int] | None] | None = None) -> list[Sequence]:
        """Queue a request's choices (``sampling_params.n`` of them); returns them.

        ``outputs``: a resubmitted request's output tokens per choice, already with its client;
        each choice goes on from its own (None: it ended, and is not queued)."""
        n = seq.sampling_params.n
        if len(self._waiting) + n > self.limits.max_num_waiting:
            raise QueueFull(len(self._waiting), self.limits.max_num_waiting)
        choices = [seq] + [seq.choice(i) for i in range(1, n)]
        if outputs is not None:
            choices = [c.going_on_from(o) for c, o in zip(choices, outputs, strict=True) if o is not None]
        arrival = next(self._arrivals)
        for choice in choices:
            choice.arrival = arrival
            self.seqs[choice.seq_id] = choice
            self._enqueue(choice)
        self._request_seqs[seq.request_id] = [c.seq_id for c in choices]
        return choices

    def abort(self, request_or_seq_id: str) -> list[Sequence]:
        """Finish a whole request, or one of its choices, as aborted; returns what was finished."""
        aborted = self._unfinished(request_or_seq_id)
        for seq in aborted:
            self._finish(seq, FinishReason.ABORT)
        return aborted

    def pause(self, request_or_seq_id: str, deadline: float) -> list[Sequence]:
        """Stop computing a request (or one choice) until ``resume``; see ``pausing.pause``."""
        return pausing.pause(self, request_or_seq_id, deadline)

    def resume(self, request_or_seq_id: str) -> list[Sequence]:
        """Queue paused sequences again, in their old place; returns them."""
        return pausing.resume(self, request_or_seq_id)

    def expire_paused(self, now: float) -> list[Sequence]:
        """Abort the paused sequences whose deadline has come; returns them."""
        return pausing.expire_paused(self, now)

    def _unfinished(self, request_or_seq_id: str) -> list[Sequence]:
        ids = self._request_seqs.get(request_or_seq_id, [request_or_seq_id])
        return [self.seqs[s] for s in ids if s in self.seqs]

    def _enqueue(self, seq: Sequence) -> None:
        self._waiting.push(seq.seq_id, seq.order, seq.tenant)

    def _dequeue(self, seq: Sequence) -> None:
        self._waiting.remove(seq.seq_id)

    def schedule(self) -> SchedulerOutput:
        plan = Plan(next(self._step_ids), self.limits.max_num_batched_tokens)
        kv_saves = self.kv_tiers.take_saves()  # queued before this plan: earlier plans computed them
        handoff = self.kv_tiers.take_handoff()
        for decoding in (True, False):
            for seq in list(self._running):
                if plan.budget == 0:
                    break
                is_decode = seq.num_uncomputed_tokens == 1
                if seq.status is SequenceStatus.RUNNING and is_decode == decoding and self._can_grow(seq):
                    self._schedule_running(plan, seq)
            if decoding:  # what the drafts do not verify goes back to the prefills
                self.speculator.trim(plan, self.seqs, self._prefill_demand(plan))
        if not plan.preempted:
            admission.admit_waiting(self, plan)
        self.speculator.planned(plan)
        finished, self._finished_since_plan = tuple(self._finished_since_plan), []
        tables = self.block_manager.block_tables
        return plan.to_output(self.seqs, tables, finished, self.scheduler_id, kv_saves, handoff)

    def _prefill_demand(self, plan: Plan) -> int:
        """Tokens the rest of the plan (prefill chunks, admissions) would take if every draft were
        cut: running prefills' tokens, and those of the waiting sequences ``max_num_seqs`` leaves
        room for, up to the budget. (Counting a queue that cannot be admitted made every step look
        long and drafts free: at one running sequence with more waiting, 7-token drafts were
        verified whole where 3 made more tokens a second.)"""
        limit = plan.budget + sum(len(d) for d in plan.drafts.values())
        demand = sum(s.num_uncomputed_tokens for s in self._running if s.num_uncomputed_tokens > 1)
        num_free_slots = self.limits.max_num_seqs - len(self._running)
        for seq_id in self._waiting.peek(max(num_free_slots, 0)):  # next admitted first
            if demand >= limit:
                break
            demand += self.seqs[seq_id].num_tokens
        return min(demand, limit)

    def next_plan(self, num_in_flight: int, max_in_flight: int) -> SchedulerOutput | None:
        """The plan to send now, or None: then the caller waits for its oldest result in flight
        (or, with none in flight, for work). The one send/wait policy of StepLoop and LocalEngine.

        A plan is made while fewer than ``max_in_flight`` are out (1, or 2 with overlap) and there
        is work; one with nothing to run, nothing for the worker to drop and nothing to save is
        not sent.
        """
        if num_in_flight >= max_in_flight or not self.has_work():
            return None
        plan = self.schedule()
        work = plan.num_scheduled_seqs or plan.finished_seq_ids or plan.kv_saves or plan.partial_saves
        return plan if work or plan.handoff_drops else None

    def record_step_time(self, step_id: int, seconds: float) -> None:
        """How long the worker's forward of plan ``step_id`` took (for the speculative policy)."""
        self.speculator.policy.measured(step_id, seconds)

    def record_step_profile(self, samples: Iterable[StepSample]) -> None:
        """Steps the worker timed at start: the speculative policy's step-time model starts from them."""
        self.speculator.policy.step_time.profiled(
            [(s.num_tokens, s.num_draft_tokens, s.num_draft_rows, s.seconds) for s in samples]
        )

    # Take a step's result; returns the sequences that changed (a method: step_results.take).
    postprocess = step_results.take

    def fail_all(self) -> list[Sequence]:
        """The worker is gone: finish every sequence with an error (nothing to tell the worker)."""
        failed = list(self.seqs.values())
        for seq in failed:
            self._finish(seq, FinishReason.ERROR)
        self._finished_since_plan = []
        self.kv_tiers.discard_saves()
        return failed

    # --- planning --------------------------------------------------------------------------

    def _can_grow(self, seq: Sequence) -> bool:
        """Whether another token may be computed: no limit is reached counting tokens in flight."""
        if seq.num_uncomputed_tokens == 0 or seq.draft_token_ids:
            return False  # (drafts in flight: how many tokens come back is not known yet)
        if seq.handoff and seq.num_computed_tokens >= seq.num_prompt_tokens:
            return False  # prefilled: its decode runs on the worker it is handed to
        if seq.num_computed_tokens < seq.num_tokens:
            return True  # prefill (or recompute) still has known tokens to compute
        params, num_pending = seq.sampling_params, seq.num_pending_tokens
        if num_pending and self.limits.num_speculative_tokens and not self.speculator.may_overlap(seq):
            return False  # waits for its result, so that the next plan can draft for it
        return (
            seq.num_output_tokens + num_pending < params.max_tokens
            and seq.num_tokens + num_pending < self.limits.context_len
        )

    def _schedule_running(self, plan: Plan, seq: Sequence) -> None:
        num_tokens = min(seq.num_uncomputed_tokens, plan.budget)
        target = seq.num_computed_tokens + num_tokens
        if num_tokens == 1 and self.limits.num_speculative_tokens:
            if seq.num_pending_tokens:
                self.speculator.overlapped(seq.seq_id)
            max_draft = min(self.limits.num_speculative_tokens, plan.budget - 1)
            draft = self.speculator.draft_for(seq, max_draft, self.limits.context_len)
            # Drafts are a guess: they never take the block a later decode of this plan may need.
            reserve = len(self._running) - len(plan.scheduled)  # (at most one new block each)
            if draft and self.block_manager.can_allocate(seq.seq_id, target + len(draft), reserve=reserve):
                self._add_to_plan(plan, seq, num_tokens, draft)
                return
        while not self.block_manager.can_allocate(seq.seq_id, target):
            victim = self._pick_victim(seq, plan)
            if victim is None:
                if num_tokens == 1:  # a decode that cannot grow makes room by going itself
                    self._preempt(seq, plan)
                return
            self._preempt(victim, plan)
        self._add_to_plan(plan, seq, num_tokens)

    def _pick_victim(self, seq: Sequence, plan: Plan) -> Sequence | None:
        """The lowest-priority running sequence after ``seq`` that is not in the plan yet."""
        for victim in reversed(self._running):
            if victim is seq or victim.order < seq.order:
                return None
            if victim.seq_id not in plan.scheduled:
                return victim
        return None

    def _preempt(self, seq: Sequence, plan: Plan) -> None:
        self._drop_from_worker(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)
        plan.preempted = True

    def _drop_from_worker(self, seq: Sequence) -> None:
        """A running sequence gives back its blocks (computed full ones stay cached) and the next
        plan tells the worker to drop it; re-admitted, it is computed again from its tokens."""
        self.kv_reuse.release(seq)
        self._running.remove(seq)
        self._finished_since_plan.append(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.prompt_done_step = 0

    def record_loads(
        self, step_id: int, num_host_blocks: int, num_store_blocks: int, failed: Mapping[str, int]
    ) -> None:
        """What the worker loaded for step ``step_id``'s new sequences. One whose load stopped short
        (seq id -> blocks) recomputed the rest: if that was its first admission, whose hit usage
        reports (even if it was preempted since), those tokens no longer count as cached."""
        self.kv_tiers.record_loads(num_host_blocks, num_store_blocks, sum(failed.values()))
        for seq_id, num_blocks in failed.items():
            seq = self.seqs.get(seq_id)
            table = self.block_manager.block_tables.get(seq_id)
            if seq is not None and table is not None:
                self.kv_tiers.recomputed(seq, table, num_blocks)
            if seq is not None and seq.cached_step == step_id:
                seq.num_cached_tokens = max(0, seq.num_cached_tokens - num_blocks * self.limits.block_size)

    def _add_to_plan(
        self, plan: Plan, seq: Sequence, num_tokens: int, draft: list[int] | None = None
    ) -> None:
        if seq.seq_id not in plan.kv_loads:  # blocks loaded by this plan are cached from the next
            self.kv_reuse.cache_computed_blocks(seq)  # before this plan's chunk: earlier plans computed them
        plan.num_computed_before[seq.seq_id] = seq.num_computed_tokens
        target = seq.num_computed_tokens + num_tokens
        # Blocks for the drafts too; they count as computed only once verified (postprocess).
        num_drafted = len(draft or ())
        plan.new_blocks[seq.seq_id] = self.block_manager.allocate(seq.seq_id, target + num_drafted)
        plan.scheduled[seq.seq_id] = num_tokens
        plan.budget -= num_tokens + num_drafted
        if draft:
            plan.drafts[seq.seq_id] = seq.draft_token_ids = draft
        # Samples iff the chunk reaches the end of what the worker knows.
        samples = target == seq.num_tokens + seq.num_pending_tokens
        seq.num_computed_tokens = target
        if target >= seq.num_prompt_tokens and seq.prompt_done_step == 0:
            seq.prompt_done_step = plan.step_id
            self.kv_reuse.save(seq, seq.num_prompt_tokens)  # store point: the end of the user input
        if samples:
            seq.num_pending_tokens += 1
            plan.num_sampling += 1

    # --- finishing -------------------------------------------------------------------------

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
            if reason is FinishReason.ERROR:
                # Its last plans' KV may never have been written (the worker refused or failed
                # the row), and a plan in flight may have cached some of it already: none of its
                # blocks enter the cache, and those it cached leave it.
                self.block_manager.free(seq.seq_id, forget=True)
                self.kv_tiers.discard_saves_of(seq)
            else:
                self.kv_reuse.save(seq, min(seq.num_computed_tokens, seq.num_tokens))  # store point
                self.kv_reuse.release(seq)
            self._finished_since_plan.append(seq.seq_id)
        elif seq.status is SequenceStatus.WAITING:
            self._dequeue(seq)
        self.kv_tiers.drop_partial(seq)  # handed off here, never admitted: no plan loads it
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.seqs[seq.seq_id]
        self.speculator.finished(seq, reason in (FinishReason.STOP, FinishReason.LENGTH))
        siblings = self._request_seqs.get(seq.request_id, [])
        if all(s not in self.seqs for s in siblings):
            self._request_seqs.pop(seq.request_id, None)

    def check_integrity(self) -> None:
        """Assert the core's invariants (see integrity)."""
        integrity.check_integrity(self)
