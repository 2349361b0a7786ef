"""Taking a step's result into the scheduler core: each sequence's sampled tokens (1 + its
accepted drafts), every token checked for a stop, failed rows finished alone. Pure: no nats,
asyncio or torch."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING

from libs.protocol.messages import FinishReason, Logprobs
from services.scheduler.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from services.scheduler.worker_scheduler import WorkerScheduler


def take(
    core: WorkerScheduler,
    seq_ids: tuple[str, ...],
    sampled: list[int],
    logprobs: tuple[Logprobs | None, ...] = (),
    failed: Mapping[str, str] | None = None,
    num_sampled: list[int] | None = None,
    drafts: list[tuple[int, float]] | None = None,
) -> list[Sequence]:
    """Append each sampled token; returns the sequences that changed (finished ones included).

    ``num_sampled``: tokens per sequence in ``sampled`` (None: one each); a drafted sequence
    gets 1 + its accepted drafts, which count as computed, and each token is checked for a
    stop, so nothing after one is kept. Results of sequences that finished meanwhile are
    dropped; a preempted sequence keeps its tokens (sampled from intact state before the
    worker dropped it). A ``failed`` sequence (seq id -> why) finishes with ERROR, whether it
    sampled (its token is dropped) or not (a prefill chunk, or a row the worker could not run).
    ``drafts``: per sequence, the worker's own draft to follow it, (token, probability).
    """
    changed: list[Sequence] = []
    for seq_id, why in (failed or {}).items():
        seq = core.seqs.get(seq_id)
        if seq is not None:
            seq.error = why
            core._finish(seq, FinishReason.ERROR)
            changed.append(seq)
    counts = num_sampled if num_sampled is not None else [1] * len(seq_ids)
    offsets = list(itertools.accumulate(counts, initial=0))
    for i, seq_id in enumerate(seq_ids):
        seq = core.seqs.get(seq_id)
        if seq is None:
            continue
        seq.num_pending_tokens -= 1
        seq.suspect = False  # it got through a step on this worker
        num_kept = take_tokens(core, seq, sampled[offsets[i] : offsets[i + 1]])
        if drafts and not seq.is_finished:
            core.speculator.proposed(seq, *drafts[i])
        step_logprobs = logprobs[i] if logprobs else None
        if step_logprobs is not None and num_kept:
            seq.unsent_logprobs.append(step_logprobs.head(num_kept))
        changed.append(seq)
    return changed


def take_tokens(core: WorkerScheduler, seq: Sequence, token_ids: list[int]) -> int:
    """One sequence's tokens of a step: its accepted drafts (computed now) and one more.
    Returns how many it kept: up to a stop, none when the result is not one of its draft."""
    draft, seq.draft_token_ids = seq.draft_token_ids, []
    num_accepted = len(token_ids) - 1
    if not 0 <= num_accepted <= len(draft) or token_ids[:num_accepted] != draft[:num_accepted]:
        seq.error = f"the worker returned {len(token_ids)} tokens for a draft of {len(draft)}"
        core._finish(seq, FinishReason.ERROR)
        return 0
    if seq.status is SequenceStatus.RUNNING:
        seq.num_computed_tokens += num_accepted
    num_kept = len(token_ids)
    for i, token_id in enumerate(token_ids):
        seq.output_token_ids.append(token_id)
        reason = check_stop(seq, token_id, core.limits.context_len)
        if reason is not None:
            core._finish(seq, reason)
            num_kept = i + 1
            break
    if draft:
        core.speculator.verified(seq, len(draft), num_accepted, num_kept)
    return num_kept


def check_stop(seq: Sequence, token_id: int, context_len: int) -> FinishReason | None:
    """Why the sequence ends at this token (just appended), or None."""
    if token_id in seq.stop_token_ids and seq.num_output_tokens > seq.sampling_params.min_tokens:
        return FinishReason.STOP
    if seq.num_output_tokens >= seq.sampling_params.max_tokens or seq.num_tokens >= context_len:
        return FinishReason.LENGTH
    return None
