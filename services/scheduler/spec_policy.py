"""How much of each draft a step verifies (``--speculative-policy``). Pure: no nats, asyncio or torch.

``fixed`` verifies every draft whole (up to ``--speculative-max-tokens``). ``adaptive`` (after
DeepSeek's DSpark and vLLM's confidence-scheduled verification) verifies, per plan, the prefix of
each draft that makes the most tokens per second of step time:

- ``AcceptancePredictor`` estimates, for each drafted position j, the chance it is accepted given
  that the ones before it were: smoothed counts by source, match length and position, pulled
  toward the sequence's own record (a request that copies its prompt keeps copying).
- ``StepTimeModel`` predicts a step's time from its tokens, its drafted tokens, its drafted rows
  and whether it computes more than one token, fitted to the worker's measured forward times and
  to the steps it timed at start (guesses stand in for a worker that sent none).
- ``verify_lengths`` maximizes (sampling rows + expected accepted drafts) / step time over the
  prefix length of every draft (Dinkelbach's ratio iteration; per sequence the gains fall with
  the position, so a few rounds settle it). Where tokens are most of a step's cost (many decode
  rows) or acceptance is low, a drafted token does not pay for its share of the step and nothing
  is verified; beside a long prefill chunk, which makes the step long anyway, drafts come cheap.

A sequence's first draft is verified whole, so that its own record starts (one request copies
its prompt, the next does not; a client's prediction is right or wrong as a whole). A source
nobody verifies would keep its estimate forever, so one of its drafts is verified whole after
``EXPLORE_EVERY`` plans that drafted it without verifying any, the wait doubling (to
``MAX_EXPLORE_EVERY``) while it still does not pay, so a wrong source costs ever less. And one
slow step (a first run of new shapes, a pause) must not stop drafting for long, so a measured
step counts as at most ``MAX_SURPRISE`` times what the model predicted for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final

POLICIES: Final = ("adaptive", "fixed")
EXPLORE_EVERY: Final = 8  # plans a source may draft without any of it verified, at first ...
MAX_EXPLORE_EVERY: Final = 64  # ... doubling per exploration after which it still does not pay
MAX_MATCH_BUCKET: Final = 4  # an MTP draft's probability falls in one of buckets 1..this
HALVE_AT: Final = 4096.0  # counts halve past this many reached positions, to follow a change
SEQ_HALVE_AT: Final = 32.0  # ... and a sequence's own, sooner: a request copies, then writes anew
MAX_SURPRISE: Final = 2.0  # a measured step counts as at most this many times its prediction


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

    def has_record(self, seq_id: str) -> bool:
        """Whether a draft of the sequence was verified here (while it lives)."""
        return seq_id in self._by_seq

    def forget(self, seq_id: str) -> None:
        self._by_seq.pop(seq_id, None)

    def check_integrity(self, live_seq_ids: set[str]) -> None:
        assert self._by_seq.keys() <= live_seq_ids, "a finished sequence's acceptance record"
        for tally in (*self._by_position.values(), *self._by_match.values(), *self._by_seq.values()):
            assert 0 <= tally.num_accepted <= tally.num_reached <= HALVE_AT


# Features of a step: (1, tokens computed, drafted tokens among them, rows verifying a draft,
# 1 if it computes more than one token). Drafted tokens get their own term: in a decode row they
# cost what decode tokens cost, which on a CPU is well above the per-token cost of a long prefill
# chunk. The last term is the step from matrix-vector to matrix-matrix products, where a BLAS
# may charge a second row far more than a token's share (MKL's F.linear in fp32: one lone
# SmolLM2 decode 57 ms, 2-8 tokens 105-128 ms), so verifying a draft beside one decode pays it
# once. It fits to about 0 on a GPU, and on this CPU since the projections run weight-major
# (libs/kernels/linear.py).
# Prior pseudo-rows (features, seconds, weight) never decay, so they matter only until measured
# steps outweigh them. The worker's start-up profile (``StepTimeModel.profiled``) gives real
# ones; without it, guesses:
# - a decode costs about as much as 40 tokens (a - 40 b = 0): scale-free, so the first measured
#   step (often a long prefill) already gives a sensible a and b;
# - a decode takes 10 ms, weighing almost nothing: only the scale before any step is measured;
# - a drafted token or row, or a second token, costs nothing beyond a token (d = c = w = 0), as
#   firmly as one step: the optimistic guess, so that drafts get verified and their real cost
#   measured.
# Beside a profile the guesses stay at a thousandth of their weight: they only keep the fit
# defined where the profile's shapes leave a term open (a worker of one row cannot tell a row's
# cost from a token's).
_NUM_FEATURES: Final = 5
_GUESSES: Final = (
    ((1.0, -40.0, 0.0, 0.0, 0.0), 0.0, 1.0),
    ((1.0, 1.0, 0.0, 0.0, 0.0), 0.010, 1e-4),
    ((0.0, 0.0, 1.0, 0.0, 0.0), 0.0, 1.0),
    ((0.0, 0.0, 0.0, 1.0, 0.0), 0.0, 1.0),
    ((0.0, 0.0, 0.0, 0.0, 1.0), 0.0, 1.0),
)
PROFILE_WEIGHT: Final = 0.5  # a profiled step weighs half a measured one, and never decays
GUESS_WEIGHT_BESIDE_PROFILE: Final = 1e-3


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a @ x = b for a symmetric positive definite ``a`` (Gaussian elimination, pivoting)."""
    n = len(b)
    m = [[*row, v] for row, v in zip(a, b, strict=True)]
    for i in range(n):
        pivot = max(range(i, n), key=lambda r: abs(m[r][i]))
        m[i], m[pivot] = m[pivot], m[i]
        for r in range(i + 1, n):
            f = m[r][i] / m[i][i]
            for c in range(i, n + 1):
                m[r][c] -= f * m[i][c]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][c] * x[c] for c in range(i + 1, n))) / m[i][i]
    return x


@dataclass(slots=True)
class StepTimeModel:
    """Step seconds = a + b * num_tokens + d * num_draft_tokens + c * num_draft_rows + w * (more
    than one token), by least squares over measured steps, older ones weighing ``decay`` as much
    per step (recursive least squares), and prior rows that never decay: the worker's start-up
    profile, else guesses. ``coef`` is (a, b, d, c, w)."""

    decay: float = 0.98
    _xtx: list[list[float]] = field(
        default_factory=lambda: [[0.0] * _NUM_FEATURES for _ in range(_NUM_FEATURES)]
    )
    _xty: list[float] = field(default_factory=lambda: [0.0] * _NUM_FEATURES)
    _prior: list[tuple[tuple[float, ...], float, float]] = field(default_factory=lambda: list(_GUESSES))
    num_observed: int = 0
    num_profiled: int = 0
    max_profiled_tokens: int = 0  # the largest profiled step's tokens (0: no profile)
    coef: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)

    def __post_init__(self) -> None:
        self._fit()

    def profiled(self, samples: list[tuple[int, int, int, float]]) -> None:
        """Steps the worker timed at start, as (tokens, drafted tokens, drafted rows, seconds):
        they replace the guesses as the fit's prior. Samples that are not positive finite times
        are left out."""
        rows = [
            (_features(t, d, r), seconds, PROFILE_WEIGHT)
            for t, d, r, seconds in samples
            if math.isfinite(seconds) and seconds > 0 and _is_step(t, d, r)
        ]
        if not rows:
            return
        guesses = [(x, seconds, weight * GUESS_WEIGHT_BESIDE_PROFILE) for x, seconds, weight in _GUESSES]
        self._prior = guesses + rows
        self.num_profiled = len(rows)
        self.max_profiled_tokens = max(t for t, *_ in samples)
        self._fit()

    def observe(self, num_tokens: int, num_draft_tokens: int, num_draft_rows: int, seconds: float) -> None:
        # The first steps set the scale where no profile did, whatever the guesses said, and a
        # step larger than any the profile timed (a long prefill) is not clipped by an
        # extrapolation either.
        if self.num_observed >= 3 or num_tokens <= self.max_profiled_tokens:
            seconds = min(seconds, MAX_SURPRISE * self.seconds(num_tokens, num_draft_tokens, num_draft_rows))
        x = _features(num_tokens, num_draft_tokens, num_draft_rows)
        for i in range(_NUM_FEATURES):
            self._xty[i] = self.decay * self._xty[i] + x[i] * seconds
            for j in range(_NUM_FEATURES):
                self._xtx[i][j] = self.decay * self._xtx[i][j] + x[i] * x[j]
        self.num_observed += 1
        self._fit()

    def seconds(self, num_tokens: int, num_draft_tokens: int = 0, num_draft_rows: int = 0) -> float:
        a, b, d, c, w = self.coef
        return a + b * num_tokens + d * num_draft_tokens + c * num_draft_rows + w * (num_tokens > 1)

    def _fit(self) -> None:
        xtx = [row[:] for row in self._xtx]
        xty = self._xty[:]
        for x, seconds, weight in self._prior:
            for i in range(_NUM_FEATURES):
                xty[i] += weight * x[i] * seconds
                for j in range(_NUM_FEATURES):
                    xtx[i][j] += weight * x[i] * x[j]
        a, b, d, c, w = _solve(xtx, xty)
        # A step costs something, and more work never less time (noise can fit a negative slope).
        b = max(b, 0.0)
        self.coef = (max(a, 1e-6), b, max(d, -b), max(c, 0.0), max(w, 0.0))


def _is_step(num_tokens: int, num_draft_tokens: int, num_draft_rows: int) -> bool:
    """Whether a step could compute these: a drafted row drafts at least one token and also
    computes its input token."""
    has_drafts = num_draft_tokens > 0
    fits = num_draft_rows <= num_draft_tokens <= num_tokens - num_draft_rows
    return num_tokens > 0 and (num_draft_rows > 0) == has_drafts and fits


def _features(num_tokens: int, num_draft_tokens: int, num_draft_rows: int) -> tuple[float, ...]:
    return (1.0, float(num_tokens), float(num_draft_tokens), float(num_draft_rows), float(num_tokens > 1))


def verify_lengths(
    acceptance: list[list[float]],
    num_sampling: int,
    num_tokens: int,
    step_time: StepTimeModel,
    forced: list[int] | None = None,
) -> list[int]:
    """How many drafted tokens to verify per drafted sequence (a prefix of its draft).

    ``acceptance``: per drafted sequence, the conditional acceptance of each drafted position;
    ``num_sampling``: rows of the plan that sample a token anyway; ``num_tokens``: tokens the plan
    computes besides drafts; ``forced``: per drafted sequence, a length verified whatever it pays
    (0: choose). Maximizes (num_sampling + expected accepted drafts) / step seconds."""
    gains: list[list[float]] = []  # expected tokens from verifying 1..k: cumulative products
    for rates in acceptance:
        cumulative: list[float] = []
        reach = 1.0
        for rate in rates:
            reach *= rate
            cumulative.append((cumulative[-1] if cumulative else 0.0) + reach)
        gains.append(cumulative)
    _, b, d, c, w = step_time.coef
    per_token = b + d  # what one more drafted token adds to the step
    # what verifying any draft adds besides its tokens: a row's cost, and beside one lone decode
    # (the only plan of one token) the step to matrix-matrix products
    forced = forced or [0] * len(gains)
    per_row = c + (w if num_tokens == 1 and not any(forced) else 0.0)

    def tokens_per_second(lengths: list[int]) -> float:
        expected = num_sampling + sum(g[k - 1] for g, k in zip(gains, lengths, strict=True) if k)
        num_drafted = sum(lengths)
        return expected / step_time.seconds(
            num_tokens + num_drafted, num_drafted, sum(1 for k in lengths if k)
        )

    lengths = list(forced)
    ratio = tokens_per_second(lengths)
    for _ in range(16):
        for i, cumulative in enumerate(gains):
            if forced[i]:
                continue
            best, lengths[i] = 0.0, 0
            for k, gain in enumerate(cumulative, start=1):
                value = gain - ratio * (per_token * k + per_row)
                if value > best:
                    best, lengths[i] = value, k
        new_ratio = tokens_per_second(lengths)
        if new_ratio <= ratio * (1 + 1e-9):
            break  # Dinkelbach's iteration only ever raises the ratio; it stopped: optimal
        ratio = new_ratio
    return lengths


@dataclass(slots=True)
class VerifyPolicy:
    """The policy a scheduler core asks how much of each draft a plan verifies."""

    name: str = "adaptive"
    predictor: AcceptancePredictor = field(default_factory=AcceptancePredictor)
    step_time: StepTimeModel = field(default_factory=StepTimeModel)
    # source -> plans since one of its drafts was verified, while it drafted
    _unexplored: dict[str, int] = field(default_factory=dict)
    # source -> plans it may draft unverified before it is explored (absent: EXPLORE_EVERY; back
    # to that whenever the policy verifies the source by choice)
    _explore_every: dict[str, int] = field(default_factory=dict)
    _num_explored: int = 0  # explorations so far: they take the drafted sequences in turn
    _planned: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # step_id -> its features

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown speculative policy {self.name!r}: one of {', '.join(POLICIES)}")

    def planned(self, step_id: int, num_tokens: int, num_draft_tokens: int, num_draft_rows: int) -> None:
        """A plan went out computing ``num_tokens``, ``num_draft_tokens`` of them drafted in
        ``num_draft_rows`` rows."""
        if num_tokens:
            self._planned[step_id] = (num_tokens, num_draft_tokens, num_draft_rows)

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
        # A sequence's first draft: whole, so its own record starts.
        forced = [0 if self.predictor.has_record(s) else n for s, _, _, n in drafts]
        lengths = verify_lengths(rates, num_sampling, num_tokens, self.step_time, forced)
        picked_sources = {
            src for (_, src, _, _), k, f in zip(drafts, lengths, forced, strict=True) if k and not f
        }
        for source in sorted({src for _, src, _, _ in drafts}):
            of_source = [i for i, d in enumerate(drafts) if d[1] == source]
            if source in picked_sources:
                self._explore_every[source] = EXPLORE_EVERY
            if any(lengths[i] for i in of_source):
                self._unexplored[source] = 0
                continue
            every = self._explore_every.get(source, EXPLORE_EVERY)
            self._unexplored[source] = self._unexplored.get(source, 0) + 1
            if self._unexplored[source] >= every:
                # In turn, so a sequence whose own record shut it out gets tried again too; and
                # whole: every position learns, and past its first token a step grows little.
                explored = of_source[self._num_explored % len(of_source)]
                lengths[explored] = drafts[explored][3]
                self._unexplored[source], self._num_explored = 0, self._num_explored + 1
                self._explore_every[source] = min(2 * every, MAX_EXPLORE_EVERY)
        return lengths
