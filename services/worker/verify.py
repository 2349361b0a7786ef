"""Verifying drafted tokens: the state each verified position samples from, and how many drafts
a row's samples accept.

A decode with drafts ``d1..dm`` computes its input token and the drafts in one row and samples at
each of those m + 1 positions. Position i samples as a decode without speculation would after
``d1..di``: its tokens (penalties), its output count (min_tokens, and the seeded draw
``uniform_from_seed(seed, outputs so far)``) are those. Draft d(i+1) is accepted exactly when the
sample at position i equals it; the first sample that differs is kept as well, so a step returns
the samples up to and including it: 1 + the accepted drafts. For drafts that are one token per
position (n-gram, suffix, a prediction, greedy MTP) this is lossless at any temperature, and a
seeded request's output is the same with or without speculation (each token is drawn as it would
have been, from the same distribution and the same uniform).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from libs.protocol.messages import SamplingParams
from services.worker.sequence_state import SequenceState


@dataclass(frozen=True, slots=True)
class DraftPosition:
    """A drafted row's state at one verified position: its tokens before the drafts, then the
    first ``num_drafts_before`` drafts (what the sampler reads of a SequenceState)."""

    state: SequenceState
    num_known: int  # the state's tokens before its drafts
    num_drafts_before: int

    @property
    def sampling_params(self) -> SamplingParams:
        return self.state.sampling_params

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.state.stop_token_ids

    @property
    def token_ids(self) -> list[int]:
        return self.state.token_ids[: self.num_known + self.num_drafts_before]

    @property
    def num_output_tokens(self) -> int:
        return self.num_known + self.num_drafts_before - self.state.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.state.num_prompt_tokens :]


def positions(state: SequenceState, num_drafts: int) -> list[DraftPosition]:
    """The m + 1 positions of a row whose ``num_drafts`` drafts end ``state.token_ids``."""
    num_known = state.num_tokens - num_drafts
    return [DraftPosition(state, num_known, i) for i in range(num_drafts + 1)]


def num_accepted(drafts: Sequence[int], samples: Sequence[int]) -> int:
    """Drafts accepted: the longest prefix where ``samples[i] == drafts[i]`` (samples has one more)."""
    for i, (draft, sample) in enumerate(zip(drafts, samples, strict=False)):
        if draft != sample:
            return i
    return len(drafts)
