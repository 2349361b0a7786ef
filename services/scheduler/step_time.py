"""How long a worker's step takes, by its size: the speculative policy's cost model. Pure: no nats,
asyncio or torch.

Step seconds = f(tokens computed) + d * drafted tokens among them, with f piecewise linear
between the token counts in ``KNOTS`` (1, 2, 4, ... 512): a base cost, a slope from 1 token to 2,
and a change of slope at every knot. A step's cost is far from linear in its tokens. On the CPU
measured here one SmolLM2 step of 1-4 tokens costs the same (the weights stream from memory once
whatever the rows), 8 tokens cost half as much again, and from 16 on each token adds its share of
compute (services/worker/step_profile.py's log; docs/speculative-decoding.md). A GPU is flat far
longer. A straight line through such points puts a drafted token at several times its cost where
the step is flat and below it where it is not; the hinges let each stretch have its own slope.
``d`` is what a drafted token costs beyond other tokens (a verification row's attention); it is
kept >= 0, and the curve never falls as tokens grow, so more drafts never predict a faster step.

The fit is least squares over measured steps, older ones weighing ``decay`` as much per step
(recursive least squares), plus prior rows that never decay: the worker's start-up profile
(``profiled``), else guesses. Beside the data, each slope change is pulled toward 0 by a prior
row weighing as one step (a thousandth of that beside a profile): where no step of some size was
measured, the curve goes on at the slope of the last stretch that was.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Final

KNOTS: Final = (2, 4, 8, 16, 32, 64, 128, 256, 512)  # token counts where the slope may change
MAX_SURPRISE: Final = 2.0  # a measured step counts as at most this many times its prediction
PROFILE_WEIGHT: Final = 0.5  # a profiled step weighs half a measured one, and never decays
GUESS_WEIGHT_BESIDE_PROFILE: Final = 1e-3

# Features: (1, tokens, max(0, tokens - knot) for each knot, drafted tokens).
_NUM_FEATURES: Final = 3 + len(KNOTS)
_DRAFT: Final = _NUM_FEATURES - 1


def _unit(i: int) -> tuple[float, ...]:
    return tuple(float(j == i) for j in range(_NUM_FEATURES))


# Prior pseudo-rows (features, seconds, weight). Without a profile, guesses:
# - a decode costs about as much as 40 tokens (a - 40 * slope = 0): scale-free, so the first
#   measured step (often a long prefill) already gives a sensible base and slope;
# - a decode takes 10 ms, weighing less still: only the scale before any step is measured;
# - a drafted token costs nothing beyond a token: the optimistic guess, so that drafts get
#   verified and their real cost measured;
# - no slope changes at any knot (a straight line until steps show otherwise).
# The first three weigh little beside measured steps, which soon tell these terms (a step may be
# flat, as one decode's is on a CPU, whatever the first guess said). The last weighs as a step
# does: with steps of only a few sizes measured, as at start, a slow one among them must not bend
# the curve wildly between them; where steps of many sizes were measured they outweigh it.
# Beside a profile the guesses stay at a thousandth of their weight: they only keep the fit
# defined where the profile's sizes leave a term open.
_GUESSES: Final = (
    ((1.0, -40.0) + (0.0,) * (_NUM_FEATURES - 2), 0.0, 1e-4),
    ((1.0, 1.0) + (0.0,) * (_NUM_FEATURES - 2), 0.010, 1e-6),
    (_unit(_DRAFT), 0.0, 1e-2),
    *((_unit(2 + i), 0.0, 1.0) for i in range(len(KNOTS))),
)


def _features(num_tokens: int, num_draft_tokens: int) -> tuple[float, ...]:
    hinges = tuple(float(max(0, num_tokens - knot)) for knot in KNOTS)
    return (1.0, float(num_tokens), *hinges, float(num_draft_tokens))


def _normal_sums(rows: list[tuple[tuple[float, ...], float, float]]) -> tuple[list[list[float]], list[float]]:
    """Weighted (X^T X, X^T y) of rows given as (features, seconds, weight)."""
    xtx = [
        [sum(w * x[i] * x[j] for x, _, w in rows) for j in range(_NUM_FEATURES)] for i in range(_NUM_FEATURES)
    ]
    xty = [sum(w * x[i] * seconds for x, seconds, w in rows) for i in range(_NUM_FEATURES)]
    return xtx, xty


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


def is_step(num_tokens: int, num_draft_tokens: int, num_draft_rows: int) -> bool:
    """Whether a step could compute these: a drafted row drafts at least one token and also
    computes its input token."""
    has_drafts = num_draft_tokens > 0
    fits = num_draft_rows <= num_draft_tokens <= num_tokens - num_draft_rows
    return num_tokens > 0 and (num_draft_rows > 0) == has_drafts and fits


@dataclass(slots=True)
class StepTimeModel:
    """Step seconds from tokens computed and drafted tokens among them (the module's docstring).
    ``coef`` is (base, slope from 1 token, slope change at each of ``KNOTS``..., drafted token)."""

    decay: float = 0.98
    _xtx: list[list[float]] = field(
        default_factory=lambda: [[0.0] * _NUM_FEATURES for _ in range(_NUM_FEATURES)]
    )
    _xty: list[float] = field(default_factory=lambda: [0.0] * _NUM_FEATURES)
    # the prior rows' (weighted X^T X, X^T y), summed once: they never decay
    _prior: tuple[list[list[float]], list[float]] = field(
        default_factory=lambda: _normal_sums(list(_GUESSES))
    )
    num_observed: int = 0
    num_profiled: int = 0
    max_profiled_tokens: int = 0  # the largest profiled step's tokens (0: no profile)
    coef: tuple[float, ...] = (0.0,) * _NUM_FEATURES

    def __post_init__(self) -> None:
        self._fit()

    def profiled(self, samples: list[tuple[int, int, int, float]]) -> None:
        """Steps the worker timed at start, as (tokens, drafted tokens, drafted rows, seconds):
        they replace the guesses as the fit's prior. Samples that are not positive finite times,
        or no step, are left out."""
        kept = [
            (t, d, seconds)
            for t, d, r, seconds in samples
            if math.isfinite(seconds) and seconds > 0 and is_step(t, d, r)
        ]
        if not kept:
            return
        guesses = [(x, seconds, weight * GUESS_WEIGHT_BESIDE_PROFILE) for x, seconds, weight in _GUESSES]
        profile = [(_features(t, d), seconds, PROFILE_WEIGHT) for t, d, seconds in kept]
        self._prior = _normal_sums(guesses + profile)
        self.num_profiled = len(kept)
        self.max_profiled_tokens = max(t for t, _, _ in kept)
        self._fit()

    def observe(self, num_tokens: int, num_draft_tokens: int, seconds: float) -> None:
        # The first step sets the scale where no profile did, whatever the guesses said, and a
        # first step larger than any the profile timed (a long prefill) is not clipped by an
        # extrapolation either. From then on one slow step (a first run of new shapes, a grammar
        # compiled before its first mask, a pause) counts as at most MAX_SURPRISE times the
        # prediction, so it cannot stop drafting for long: with few sizes measured, one such step
        # would bend the curve between them. A real change of speed gets there in a few steps.
        if self.num_observed >= 1 or num_tokens <= self.max_profiled_tokens:
            seconds = min(seconds, MAX_SURPRISE * self.seconds(num_tokens, num_draft_tokens))
        x = _features(num_tokens, num_draft_tokens)
        for i in range(_NUM_FEATURES):
            self._xty[i] = self.decay * self._xty[i] + x[i] * seconds
            for j in range(_NUM_FEATURES):
                self._xtx[i][j] = self.decay * self._xtx[i][j] + x[i] * x[j]
        self.num_observed += 1
        self._fit()

    def seconds(self, num_tokens: int, num_draft_tokens: int = 0) -> float:
        return sum(c * x for c, x in zip(self.coef, _features(num_tokens, num_draft_tokens), strict=True))

    def seconds_with_drafts(self, num_tokens: int, num_draft_tokens: int, max_more: int) -> list[float]:
        """``seconds(num_tokens + m, num_draft_tokens + m)`` for m = 0..max_more, each from the
        one before (a plan's policy weighs every count of drafted tokens: O(1) each)."""
        _, slope, *changes, draft = self.coef
        num_bends = sum(1 for knot in KNOTS if knot < num_tokens)  # bends behind the first step
        slope += sum(changes[:num_bends])
        times = [self.seconds(num_tokens, num_draft_tokens)]
        for n in range(num_tokens + 1, num_tokens + max_more + 1):
            if num_bends < len(KNOTS) and KNOTS[num_bends] < n:  # past a knot: its stretch's slope
                slope += changes[num_bends]
                num_bends += 1
            times.append(times[-1] + slope + draft)
        return times

    def _fit(self) -> None:
        prior_xtx, prior_xty = self._prior
        xtx = [
            [a + b for a, b in zip(row, prior, strict=True)]
            for row, prior in zip(self._xtx, prior_xtx, strict=True)
        ]
        xty = [a + b for a, b in zip(self._xty, prior_xty, strict=True)]
        base, *slopes, draft = _solve(xtx, xty)
        # A step costs something, and more work never less time (noise can fit a negative
        # slope): each stretch's slope is kept >= 0 on its own, the others' left as fitted.
        fitted = itertools.accumulate(slopes)  # each stretch's slope
        kept = [max(slope, 0.0) for slope in fitted]
        changes = [b - a for a, b in zip([0.0, *kept], kept, strict=False)]
        self.coef = (max(base, 1e-6), *changes, max(draft, 0.0))
