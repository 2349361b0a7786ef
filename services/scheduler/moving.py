"""Moving sequences between worker schedulers: detach from one core, attach to another. Pure: no
nats, asyncio or torch.

A move has preemption semantics, never those of a failure: a detached sequence keeps its prompt,
the tokens it has produced and what has been sent of them; it leaves its worker as in a
preemption (its computed full blocks cached there and queued for saving to the lower tiers, so
a target that reads the shared store may load them), and the target core admits it like a
preempted sequence: over the longest prefix its tiers hold, computing the rest. Tokens that plans
in flight on the old worker would have sampled are dropped with them and sampled again on the
target; sampling depends on (seed, position) only, so they come out the same.

P/D handoff, migration after a worker's death and drain all go through ``detach`` (or
``take_all``, for a worker that is gone) and ``attach``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.scheduler.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from services.scheduler.worker_scheduler import WorkerScheduler


def detach(core: WorkerScheduler, request_id: str) -> list[Sequence]:
    """Take a request's unfinished sequences off a core whose worker is alive: a running one
    leaves the worker as in a preemption (the next plan drops it there); returns them, in
    choice order, no longer known to ``core``."""
    seqs = core._unfinished(request_id)
    for seq in seqs:
        if seq.status is SequenceStatus.RUNNING:
            core.kv_reuse.save(seq, min(seq.num_computed_tokens, seq.num_tokens))
            core._drop_from_worker(seq)
            seq.status = SequenceStatus.WAITING
            seq.num_moves += 1
        elif seq.status is SequenceStatus.WAITING:
            core._dequeue(seq)
        _forget(core, seq)
    return seqs


def take_all(core: WorkerScheduler) -> tuple[list[Sequence], set[str]]:
    """Every unfinished sequence of a core whose worker is gone (the core is retired after this),
    and the requests that had a sequence in the worker's batch (the suspects of a crash)."""
    seqs = list(core.seqs.values())
    in_batch = {s.request_id for s in seqs if s.status is SequenceStatus.RUNNING}
    for seq in seqs:
        if seq.status is SequenceStatus.RUNNING:
            seq.num_moves += 1
            seq.status = SequenceStatus.WAITING
    core.seqs.clear()
    core._request_seqs.clear()
    core._running.clear()
    core._waiting.clear()
    core._finished_since_plan.clear()
    core.kv_tiers.discard_saves()
    return seqs, in_batch


def attach(core: WorkerScheduler, seqs: list[Sequence], same_chain: bool, suspect: bool) -> None:
    """Queue a request's moved sequences on ``core``, ahead of its own queue (their clients are
    mid-stream). ``same_chain``: the target hashes blocks as the source did, so the sequences'
    chains and G3 counts still hold; ``suspect``: the request was in a crashed worker's batch,
    so it is admitted alone among suspects (see ``admission.admit_waiting``)."""
    arrival = next(core._front_arrivals)
    for seq in seqs:
        _reset(seq, same_chain)
        seq.arrival = arrival
        seq.suspect = suspect
        core.seqs[seq.seq_id] = seq
        if seq.status is not SequenceStatus.PAUSED:
            seq.status = SequenceStatus.WAITING
            core._enqueue(seq)
    request_id = seqs[0].request_id
    core._request_seqs[request_id] = [s.seq_id for s in seqs]


def _reset(seq: Sequence, same_chain: bool) -> None:
    """The target worker holds nothing of it: no KV computed, nothing sampled in flight."""
    seq.num_computed_tokens = 0
    seq.num_pending_tokens = 0
    seq.draft_token_ids = []  # verified (or not) by the source worker, whose result is void
    seq.prompt_done_step = 0
    if same_chain:
        # Blocks sent in saves went to the shared store, unless the worker died first (or had
        # them in G2 only): a load of one that is not there is recomputed, so a guess too high
        # costs a recompute, never wrong KV.
        seq.num_stored_blocks = max(seq.num_stored_blocks, seq.num_saved_blocks)
    seq.num_saved_blocks = 0
    seq.loaded_blocks = (0, 0)
    if not same_chain:
        seq.block_hashes = []  # grown again lazily, with the target's hasher
        seq.num_stored_blocks = 0


def _forget(core: WorkerScheduler, seq: Sequence) -> None:
    del core.seqs[seq.seq_id]
    core.speculator.forget(seq.seq_id)
    siblings = core._request_seqs.get(seq.request_id, [])
    if all(s not in core.seqs for s in siblings):
        core._request_seqs.pop(seq.request_id, None)
