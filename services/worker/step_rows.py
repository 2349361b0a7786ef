"""A step's rows as the step driver (ModelRunner) lays them out, what they sampled, and how drafts
shape them: a decode's draft cut to what can be verified, each constrained row's mask request (one
mask per sampled position), and the rows the MTP drafter reads after the forward."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch

from libs.protocol.messages import Logprobs
from services.worker.forward_executor import ForwardBatch
from services.worker.mask_job import MaskRequest
from services.worker.mtp_drafter import MTPRow
from services.worker.row_isolation import PlanError
from services.worker.sequence_state import SequenceState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepRow:
    state: SequenceState
    num_tokens: int  # computed in this step, from state.num_computed_tokens on
    num_drafts: int = 0  # drafted tokens at the end of those (and of state.token_ids), verified here

    @property
    def num_samples(self) -> int:
        """Positions it samples at: its last, and each drafted one before it (0: none)."""
        return 1 + self.num_drafts if self.samples else 0

    @property
    def samples(self) -> bool:
        """Whether its chunk reaches the end of the tokens it knows (only before it is computed)."""
        return self.state.num_computed_tokens + self.num_tokens == self.state.num_tokens

    @property
    def seq_id(self) -> str:
        return self.state.seq_id


@dataclass(frozen=True, slots=True)
class ImageRows:
    """Flat batch positions whose embeddings are replaced, and the rows that replace them."""

    positions: list[int]
    embeds: torch.Tensor  # [len(positions), hidden]


def forward_batch(rows: list[StepRow], images: ImageRows | None = None) -> ForwardBatch:
    """The ForwardBatch of ``rows`` in order: each computes ``num_tokens`` tokens from its
    ``num_computed_tokens``, and the rows that sample want the logits of their sampled positions."""
    input_ids: list[int] = []
    positions: list[int] = []
    logits_index: list[int] = []
    for row in rows:
        start = row.state.num_computed_tokens
        end = start + row.num_tokens
        input_ids += row.state.token_ids[start:end]
        positions += range(start, end)
        logits_index += range(len(input_ids) - row.num_samples, len(input_ids))
    return ForwardBatch(
        input_ids,
        positions,
        query_lens=[r.num_tokens for r in rows],
        context_lens=[r.state.num_computed_tokens for r in rows],
        block_tables=[r.state.block_table for r in rows],
        logits_index=logits_index,
        image_rows=images.positions if images is not None else [],
        image_embeds=images.embeds if images is not None else None,
    )


@dataclass(frozen=True, slots=True)
class Sampled:
    rows: list[StepRow]  # the rows that sampled, in layout order
    token_ids: list[list[int]]  # per row: its sampled tokens (a drafted row's: 1 + accepted drafts)
    logprobs: list[Logprobs | None]
    failed: dict[str, str]  # seq_id -> why its grammar cannot be used (the row sampled a stop token)
    drafts: list[tuple[int, float]] = field(default_factory=list)  # per row: the drafter's (token, p)


NO_SAMPLES = Sampled([], [], [], {})


def with_drafts(row: StepRow, draft: list[int], vocab_size: int) -> StepRow:
    """A decode row that also verifies ``draft`` (appended to its tokens until verified). A
    constrained row verifies what its grammar allows of it (``SequenceGrammar.num_usable``)."""
    state = row.state
    if not draft:
        return row
    if row.num_tokens != 1 or state.num_computed_tokens + 1 != state.num_tokens:
        raise PlanError(f"{state.seq_id}: drafts for a row that is not a decode")
    # A token the model has none of (a client's prediction may hold one) is never sampled, so
    # the draft is verified up to it: the same result, and no embedding lookup fails.
    draft = list(itertools.takewhile(lambda t: 0 <= t < vocab_size, draft))
    if draft and state.grammar is not None:
        remaining = state.sampling_params.max_tokens - state.num_output_tokens
        try:
            draft = draft[: state.grammar.num_usable(draft, remaining)]
        except Exception:  # a draft is optional: the row decodes one token as without one
            log.exception("%s: its grammar could not check a draft", state.seq_id)
            draft = []
    if not draft:
        return row
    state.token_ids += draft
    return StepRow(state, 1 + len(draft), len(draft))


def mask_requests(sampling: list[StepRow]) -> list[MaskRequest]:
    """The masks ``sampling``'s constrained rows need, at their first sampled positions."""
    requests: list[MaskRequest] = []
    position = 0
    for row in sampling:
        state = row.state
        if state.grammar is not None and state.grammar.active:
            num_known = state.num_tokens - row.num_drafts  # its tokens before the drafts
            remaining = state.sampling_params.max_tokens - (num_known - state.num_prompt_tokens)
            requests.append(MaskRequest(position, state.grammar, remaining, state.token_ids[num_known:]))
        position += row.num_samples
    return requests


def drafter_rows(
    rows: list[StepRow], starts: list[int], sampled: Sampled, failed: dict[str, str]
) -> list[MTPRow]:
    """The rows of a step that ran in one forward (``starts``: each one's first position), as the
    MTP drafter reads them after sampling and rollback; failed rows left out."""
    sampling = {row.seq_id for row in sampled.rows}
    offsets = itertools.accumulate((row.num_tokens for row in rows), initial=0)
    return [
        MTPRow(state.token_ids, start, state.num_computed_tokens - start, at, state.block_table, samples)
        for row, start, at in zip(rows, starts, offsets, strict=False)  # (offsets has one more)
        if row.seq_id not in failed
        for state, samples in [(row.state, row.seq_id in sampling)]
    ]
