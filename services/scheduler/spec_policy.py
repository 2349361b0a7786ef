"""How much of each draft a step verifies (``--speculative-policy``). Pure: no nats, asyncio or torch.

``fixed`` verifies every draft whole (up to ``--speculative-max-tokens``). ``adaptive`` (after
DeepSeek's DSpark and vLLM's confidence-scheduled verification) verifies, per plan, the prefix of
each draft that makes the most tokens per second of step time:

- ``AcceptancePredictor`` estimates, for each drafted position j, the chance it is accepted given
  that the ones before it were: smoothed counts by source, match length and position, pulled
  toward the sequence's own record (a request that copies its prompt keeps copying).
- ``StepTimeModel`` (services/scheduler/step_time.py) predicts a step's time from its tokens
  and its drafted tokens, piecewise linear in the tokens, fitted to the worker's measured forward
  times and to the steps it timed at start (guesses stand in for a worker that sent none).
- ``verify_lengths`` maximizes (sampling rows + expected accepted drafts) / step time over the
  prefix length of every draft: for each number of drafted tokens the likeliest positions, and
  the best of those numbers. Where tokens are most of a step's cost (many decode rows) or
  acceptance is low, drafted tokens do not pay for their share of the step and nothing is
  verified; where the step is flat (one decode on a CPU, a GPU's small batches) or beside a long
  prefill chunk, which makes the step long anyway, drafts come cheap.

A draft the policy cuts whole is still scored: the worker accepts a drafted token exactly when it
equals its own sample at that position, drawn from (seed, position), so the tokens that come
instead tell how much of the draft would have been accepted (services/scheduler/speculation.py,
``Speculator``'s shadows), and the counts learn from it as from a verification. No draft has to
be verified, at a cost, only to learn: a source or a sequence whose drafts do not pay now keeps
its estimate current, and is verified again once they would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final

from services.scheduler.step_time import StepTimeModel

POLICIES: Final = ("adaptive", "fixed")
MAX_MATCH_BUCKET: Final = 4  # an MTP draft's probability falls in one of buckets 1..this
HALVE_AT: Final = 4096.0  # counts halve past this many reached positions, to follow a change
SEQ_HALVE_AT: Final = 32.0  # ... and a sequence's own, sooner: a request copies, then writes anew


def match_bucket(match_len: int) -> int:
    """The acceptance counts' bucket for a draft whose source matched ``match_len`` tokens: 0..4
    as they are (MTP's probability buckets 1..``MAX_MATCH_BUCKET`` among them, kept apart), then
    5-8, 9-16 and 17 on (a draft that continues a long verbatim run, a copy of the prompt, is far
    likelier to hold than one after a common 2-gram)."""
    if match_len <= max(4, MAX_MATCH_BUCKET):
        return match_len
    return 5 if match_len <= 8 else 6 if match_len <= 16 else 7


@dataclass(slots=True)
class _Tally:
    num_accepted: float = 0.0
    num_reached: float = 0.0  # verified positions whose earlier drafts were all accepted

    def add(self, num_accepted: float, num_reached: float, halve_at: float = HALVE_AT) -> None:
        self.num_accepted += num_accepted
        self.num_reached += num_reached
        if self.num_reached > halve_at:
            self.num_accepted /= 2
            self.num_reached /= 2

    def rate(self, prior: float, weight: float) -> float:
        """The acceptance rate, smoothed toward ``prior`` as if ``weight`` positions had it."""
        return (self.num_accepted + weight * prior) / (self.num_reached + weight)


@dataclass(slots=True)
class AcceptancePredictor:
    """P(drafted position j accepted | positions 1..j-1 accepted) per (source, match length, j).

    Three levels, each smoothed toward the one above: per source and position (toward the
    position before, the first toward ``prior``), per match length too, then the sequence's own
    record (all positions pooled)."""

    prior: float = 0.5
    position_weight: float = 2.0
    match_weight: float = 4.0
    seq_weight: float = 4.0
    _by_position: dict[tuple[str, int], _Tally] = field(default_factory=dict)
    _by_match: dict[tuple[str, int, int], _Tally] = field(default_factory=dict)
    _by_seq: dict[str, _Tally] = field(default_factory=dict)

    def probabilities(self, seq_id: str, source: str, match_len: int, num_drafted: int) -> list[float]:
        """The conditional acceptance of each of ``num_drafted`` positions (1-based j = index + 1)."""
        bucket = match_bucket(match_len)
        own = self._by_seq.get(seq_id)
        rates: list[float] = []
        position = self.prior
        for j in range(1, num_drafted + 1):
            # A position seldom reached starts from the one before it: verifying only short
            # prefixes must not leave the later positions at the prior for ever.
            position = self._by_position.get((source, j), _Tally()).rate(position, self.position_weight)
            match = self._by_match.get((source, bucket, j), _Tally()).rate(position, self.match_weight)
            rates.append(own.rate(match, self.seq_weight) if own is not None else match)
        return rates

    def record(
        self,
        seq_id: str,
        source: str,
        match_len: int,
        num_verified: int,
        num_accepted: int,
        live: bool = True,
    ) -> None:
        """A verified draft prefix of ``num_verified`` held for its first ``num_accepted``; the
        sequence keeps a record only if ``live`` (not finished)."""
        bucket = match_bucket(match_len)
        for j in range(1, min(num_accepted + 1, num_verified) + 1):
            accepted = float(j <= num_accepted)
            self._by_position.setdefault((source, j), _Tally()).add(accepted, 1.0)
            self._by_match.setdefault((source, bucket, j), _Tally()).add(accepted, 1.0)
        num_reached = min(num_accepted + 1, num_verified)
        if live:
            self._by_seq.setdefault(seq_id, _Tally()).add(
                float(num_accepted), float(num_reached), SEQ_HALVE_AT
            )

    def forget(self, seq_id: str) -> None:
        self._by_seq.pop(seq_id, None)

    def check_integrity(self, live_seq_ids: set[str]) -> None:
        assert self._by_seq.keys() <= live_seq_ids, "a finished sequence's acceptance record"
        for tally in (*self._by_position.values(), *self._by_match.values(), *self._by_seq.values()):
            assert 0 <= tally.num_accepted <= tally.num_reached <= HALVE_AT


def verify_lengths(
    acceptance: list[list[float]], num_sampling: int, num_tokens: int, step_time: StepTimeModel
) -> list[int]:
    """How many drafted tokens to verify per drafted sequence (a prefix of its draft).

    ``acceptance``: per drafted sequence, the conditional acceptance of each drafted position;
    ``num_sampling``: rows of the plan that sample a token anyway; ``num_tokens``: tokens the plan
    computes besides drafts. Maximizes (num_sampling + expected accepted drafts) / step seconds.

    Drafted position j of a sequence yields a token with probability reach_j, the product of its
    rates up to j, which never grows with j. So, for any number m of drafted tokens, the m
    positions of highest reach are the most tokens m can buy, and they are prefixes; the step's
    time depends on m alone. Every m is tried, in that order, and the best ratio kept: the step
    time need not be linear in m (a CPU step is flat up to a few tokens, then not)."""
    candidates: list[tuple[float, int, int]] = []  # (-reach, sequence, position): best first
    for i, rates in enumerate(acceptance):
        reach = 1.0
        for j, rate in enumerate(rates):
            reach *= rate
            candidates.append((-reach, i, j))
    candidates.sort()
    seconds = step_time.seconds_with_drafts(num_tokens, 0, len(candidates))
    expected = float(num_sampling)
    best_ratio, best_count = expected / seconds[0], 0
    for m, (neg_reach, _, _) in enumerate(candidates, start=1):
        if neg_reach == 0.0:
            break  # nothing more to gain
        expected -= neg_reach
        if expected / seconds[m] > best_ratio:
            best_ratio, best_count = expected / seconds[m], m
    lengths = [0] * len(acceptance)
    for _, i, _ in candidates[:best_count]:
        lengths[i] += 1
    return lengths


@dataclass(slots=True)
class VerifyPolicy:
    """The policy a scheduler core asks how much of each draft a plan verifies."""

    name: str = "adaptive"
    predictor: AcceptancePredictor = field(default_factory=AcceptancePredictor)
    step_time: StepTimeModel = field(default_factory=StepTimeModel)
    _planned: dict[int, tuple[int, int]] = field(default_factory=dict)  # step_id -> (tokens, drafted)

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown speculative policy {self.name!r}: one of {', '.join(POLICIES)}")

    def planned(self, step_id: int, num_tokens: int, num_draft_tokens: int) -> None:
        """A plan went out computing ``num_tokens``, ``num_draft_tokens`` of them drafted."""
        if num_tokens:
            self._planned[step_id] = (num_tokens, num_draft_tokens)

    def measured(self, step_id: int, seconds: float) -> None:
        """The worker's forward time of plan ``step_id`` (results come back in plan order, so
        earlier plans with none are forgotten: they failed). A time that is not a positive
        finite number is not a measurement."""
        features = self._planned.pop(step_id, None)
        for stale in [s for s in self._planned if s < step_id]:
            del self._planned[stale]
        if features is not None and math.isfinite(seconds) and seconds > 0:
            self.step_time.observe(*features, seconds)

    def lengths(
        self, drafts: list[tuple[str, str, int, int]], num_sampling: int, num_tokens: int
    ) -> list[int]:
        """Tokens to verify of each draft, given as (seq_id, source, match length, its length)."""
        if self.name == "fixed":
            return [num_drafted for *_, num_drafted in drafts]
        rates = [self.predictor.probabilities(s, src, m, n) for s, src, m, n in drafts]
        return verify_lengths(rates, num_sampling, num_tokens, self.step_time)
