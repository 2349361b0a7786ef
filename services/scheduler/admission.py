"""Admission from the scheduler core's waiting queue into a plan: in the queue's order (priority,
fair between tenants, then arrival: services/scheduler/fair_queue.py), nobody overtaking the head
of the queue, one suspect at a time, the
choices of a request after their parent's prompt, each with its prefix-cache and tier hit. Pure:
no nats, asyncio or torch."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from services.scheduler.fair_queue import Entry
from services.scheduler.plan import Plan
from services.scheduler.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from services.scheduler.worker_scheduler import WorkerScheduler


def admit_waiting(core: WorkerScheduler, plan: Plan) -> None:
    """Admit waiting sequences into ``plan`` while its budget, ``max_num_seqs`` and KV blocks allow."""
    skipped: list[Entry] = []
    while core._waiting and plan.budget > 0 and len(core._running) < core.limits.max_num_seqs:
        entry = core._waiting.pop()
        seq = core.seqs[entry.seq_id]
        if seq.num_pending_tokens or waits_for_parent(core, seq, plan.step_id):
            skipped.append(entry)
            continue
        if seq.suspect and any(s.suspect for s in core._running):
            # One suspect at a time: a poison request's next crash then finds it alone
            # among the suspects, so only it reaches the crash limit.
            skipped.append(entry)
            continue
        if not try_admit(core, plan, seq):
            skipped.append(entry)
            break  # first come, first served: nobody overtakes the head of the queue
    for entry in skipped:
        core._waiting.requeue(entry)


def try_admit(core: WorkerScheduler, plan: Plan, seq: Sequence) -> bool:
    """Admit ``seq`` over its prefix hit if its blocks fit above the watermark; False: it waits."""
    num_hit_tokens = core.kv_reuse.reuse_prefix(seq, core.seqs.get(seq.request_id), plan)
    num_tokens = min(seq.num_uncomputed_tokens, plan.budget)
    target = seq.num_computed_tokens + num_tokens
    if not core.block_manager.can_allocate(seq.seq_id, target, reserve=core._watermark_blocks):
        core.block_manager.free(seq.seq_id)  # gives back a shared prompt or cache hit
        seq.num_computed_tokens = 0
        plan.kv_loads.pop(seq.seq_id, None)
        return False
    if num_hit_tokens is not None:
        load = plan.kv_loads.get(seq.seq_id)
        num_device_tokens = core.kv_tiers.record_hit(seq.num_tokens, num_hit_tokens, load)
        core.prefix_cache_stats.record(seq.num_tokens, num_device_tokens)
        # usage reports the hit of the first admission
        if seq.num_preemptions == seq.num_pauses == seq.num_moves == 0:
            seq.num_cached_tokens = min(num_hit_tokens, seq.num_prompt_tokens)
            seq.cached_step = plan.step_id
    load = plan.kv_loads.get(seq.seq_id)
    # What it loads is in the tiers (the worker puts a G3 hit in G2 as it loads it): its saves
    # skip these blocks, which would otherwise be copied out of G1 again in the next step.
    seq.loaded_blocks = (load.first_block, load.first_block + len(load.tiers)) if load else (0, 0)
    if load is not None and load.partial_key:
        seq.partial_key = b""  # the worker deletes the file once read
    # Its tenant pays for what it brings to compute (a prefix-cache hit is nearly free), counted
    # before the plan takes its first chunk into num_computed_tokens.
    core._waiting.charge(seq.tenant, max(1, seq.num_tokens - seq.num_computed_tokens), seq.tenant_weight)
    seq.status = SequenceStatus.RUNNING
    bisect.insort(core._running, seq, key=lambda s: s.order)
    plan.new_seq_ids.add(seq.seq_id)
    core._add_to_plan(plan, seq, num_tokens)
    return True


def waits_for_parent(core: WorkerScheduler, seq: Sequence, step_id: int) -> bool:
    """Choices > 0 wait until choice 0's prompt is computed in an earlier plan, then share it."""
    parent = core.seqs.get(seq.request_id) if seq.index > 0 else None
    return parent is not None and not 0 < parent.prompt_done_step < step_id
