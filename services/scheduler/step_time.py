"""How long a worker's step takes, by its size: the speculative policy's cost model. Pure: no nats,
asyncio or torch.

Step seconds = f(tokens computed) + d * drafted tokens among them, with f piecewise linear
between the token counts in ``KNOTS`` (2, 4, ... 512): a base cost and a slope for each stretch
between knots. A step's cost is far from linear in its tokens. On the CPU measured here one
SmolLM2 step of 1-4 tokens costs the same (the weights stream from memory once whatever the
rows), 8 tokens cost half as much again, and from 16 on each token adds its share of compute
(services/worker/step_profile.py's log; docs/speculative-decoding.md). A GPU is flat far longer.
A straight line through such points puts a drafted token at several times its cost where the
step is flat and below it where it is not; each stretch's own slope follows the shape. ``d`` is
what a drafted token costs beyond other tokens (a verification row's attention).

The fit is least squares over measured steps, older ones weighing ``decay`` as much per step
(recursive least squares), plus prior rows that never decay: the worker's start-up profile
(``profiled``), else guesses; beside the data, each change of slope from one stretch to the next
is pulled toward 0 (weighing as one step, a thousandth of that beside a profile): past the
largest size measured the curve goes on at the slope of the last stretch that was, and between
sizes measured the slopes blend. ``d`` is pulled toward 0 as firmly as one step with one drafted
token, beside a profile too: the profile's few shapes tell it poorly. Every slope and ``d`` are
bounded below by 0 in the fit itself (non-negative least squares), so more tokens or drafts
never predict a faster step. Clipping an unbounded fit after
the fact does not do: a token's and a drafted token's costs move together (drafted tokens are
tokens), and noise that fit d < 0 and a steep slope beside it left the steep slope once d was
raised to 0 (profiles of a busy machine had their largest step predicted at 1.2 and 2.8 times
its measured time, tests/unit/scheduler/test_step_time.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final

KNOTS: Final = (2, 4, 8, 16, 32, 64, 128, 256, 512)  # token counts where the slope may change
MAX_SURPRISE: Final = 2.0  # a measured step counts as at most this many times its prediction
PROFILE_WEIGHT: Final = 0.5  # a profiled step weighs half a measured one, and never decays
GUESS_WEIGHT_BESIDE_PROFILE: Final = 1e-3

# Parameters: (base, the slope of each stretch (..2], (2..4], ..., (512..), drafted token).
_NUM_STRETCHES: Final = len(KNOTS) + 1
_NUM_FEATURES: Final = 2 + _NUM_STRETCHES
_DRAFT: Final = _NUM_FEATURES - 1
_BOUNDED: Final = frozenset(range(1, _NUM_FEATURES))  # every slope and d: >= 0
_EDGES: Final = (0, *KNOTS)  # each stretch's first token is the one after its edge


def _unit(i: int) -> tuple[float, ...]:
    return tuple(float(j == i) for j in range(_NUM_FEATURES))


def _features(num_tokens: int, num_draft_tokens: int) -> tuple[float, ...]:
    """(1, tokens within each stretch, drafted tokens)."""
    ends = (*KNOTS, math.inf)
    within = tuple(float(max(0, min(num_tokens, end) - edge)) for edge, end in zip(_EDGES, ends, strict=True))
    return (1.0, *within, float(num_draft_tokens))


# Prior pseudo-rows (features, seconds, weight). Guesses, for a model with no profile:
# - a decode costs about as much as 40 tokens (a - 40 * slope = 0): scale-free, so the first
#   measured step (often a long prefill) already gives a sensible base and slope;
# - a decode takes 10 ms, weighing less still: only the scale before any step is measured.
# Both weigh little beside measured steps, which soon tell these terms (a step may be flat, as
# one decode's is on a CPU, whatever the first guess said), and a thousandth of that beside a
# profile: they only keep the fit defined where the profile's sizes leave a term open.
_GUESSES: Final = (
    (tuple(-x if i else x for i, x in enumerate(_features(40, 0))), 0.0, 1e-4),
    (_features(1, 0), 0.010, 1e-6),
)
# Shape: no change of slope at any knot (a straight line until steps show otherwise), and no cost
# of a drafted token beyond a token's (so drafts get verified and their real cost measured).
# These weigh as a step does: with steps of only a few sizes measured, as at start, a slow one
# among them must not bend the curve wildly between them; where steps of many sizes were measured
# they outweigh it. The slope changes weigh a thousandth of that beside a profile, whose sizes
# set the shape.
_SLOPE_CHANGES: Final = tuple(
    (tuple(_unit(k + 1)[i] - _unit(k)[i] for i in range(_NUM_FEATURES)), 0.0, 1.0)
    for k in range(1, _NUM_STRETCHES)
)
_NO_DRAFT_COST: Final = ((_unit(_DRAFT), 0.0, 1.0),)


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


def _solve_on(a: list[list[float]], b: list[float], free: list[int]) -> list[float]:
    """``_solve`` over the variables in ``free``, the others held at 0."""
    sub = _solve([[a[i][j] for j in free] for i in free], [b[i] for i in free])
    x = [0.0] * len(b)
    for i, v in zip(free, sub, strict=True):
        x[i] = v
    return x


def _nonnegative_solve(
    a: list[list[float]], b: list[float], bounded: frozenset[int], start: list[int] | None = None
) -> tuple[list[float], list[int]]:
    """argmin x^T a x - 2 b^T x with x_i >= 0 for i in ``bounded`` (Lawson and Hanson's active
    set method, on the normal equations): free the bounded variable whose increase helps most,
    solve, and step back to the bound any that the solve took below it, until none helps.
    Returns x and its free variables. ``start``: free variables to begin with (the last fit's:
    a step seldom moves a variable to or off its bound, so one solve usually ends it, where
    starting from none takes a pass per variable); dropped if their solve leaves a bound."""
    n = len(b)
    unbounded = [i for i in range(n) if i not in bounded]
    free = sorted(start) if start else unbounded
    x = _solve_on(a, b, free) if free else [0.0] * n
    if free != unbounded and any(x[i] <= 0 for i in free if i in bounded):
        free = unbounded  # the start is off: from none
        x = _solve_on(a, b, free) if free else [0.0] * n
    tolerance = 1e-12 * max(1.0, max(abs(v) for v in b))
    for _ in range(4 * n):  # a cap: the fits here end within 12 passes
        gradient = [b[i] - sum(a[i][j] * x[j] for j in range(n)) for i in range(n)]
        held = [i for i in bounded if i not in free and gradient[i] > tolerance]
        if not held:
            break
        free.append(max(held, key=lambda i: gradient[i]))
        while True:
            z = _solve_on(a, b, sorted(free))
            below = [i for i in free if i in bounded and z[i] <= 0]
            if not below:
                x = z
                break
            step = min(x[i] / (x[i] - z[i]) if x[i] > z[i] else 0.0 for i in below)
            x = [xi + step * (zi - xi) for xi, zi in zip(x, z, strict=True)]
            free = [i for i in free if i not in bounded or x[i] > tolerance]
            for i in bounded - set(free):
                x[i] = 0.0
    return x, free


def _dot(coef: tuple[float, ...], features: tuple[float, ...]) -> float:
    return sum(c * x for c, x in zip(coef, features, strict=True))


def is_step(num_tokens: int, num_draft_tokens: int, num_draft_rows: int) -> bool:
    """Whether a step could compute these: a drafted row drafts at least one token and also
    computes its input token."""
    has_drafts = num_draft_tokens > 0
    fits = num_draft_rows <= num_draft_tokens <= num_tokens - num_draft_rows
    return num_tokens > 0 and (num_draft_rows > 0) == has_drafts and fits


@dataclass(slots=True)
class StepTimeModel:
    """Step seconds from tokens computed and drafted tokens among them (the module's docstring).
    ``coef`` is (base, the slope of each stretch between ``KNOTS``..., drafted token)."""

    decay: float = 0.98
    _xtx: list[list[float]] = field(
        default_factory=lambda: [[0.0] * _NUM_FEATURES for _ in range(_NUM_FEATURES)]
    )
    _xty: list[float] = field(default_factory=lambda: [0.0] * _NUM_FEATURES)
    # the prior rows' (weighted X^T X, X^T y), summed once: they never decay
    _prior: tuple[list[list[float]], list[float]] = field(
        default_factory=lambda: _normal_sums([*_GUESSES, *_SLOPE_CHANGES, *_NO_DRAFT_COST])
    )
    num_observed: int = 0
    num_profiled: int = 0
    max_profiled_tokens: int = 0  # the largest profiled step's tokens (0: no profile)
    # The fit is made when a prediction is asked for, not per step: a scheduler whose plans draft
    # nothing never pays for it, one that drafts pays once per plan. A fit starts from the last
    # one's free variables: ~0.1 ms of Python where one from none took ~1 ms (a step at 4 rows of
    # int8 SmolLM2 is ~7 ms: the policy cost more than it won against fixed k = 3 there).
    _coef: tuple[float, ...] = ()  # the last fit's coefficients (empty: none yet)
    _free: list[int] | None = None  # the last fit's variables off their bounds
    _stale: bool = True  # steps or a profile came in since the last fit

    @property
    def coef(self) -> tuple[float, ...]:
        """(base, the slope of each stretch between ``KNOTS``..., drafted token), fitted to
        everything observed so far."""
        if self._stale:
            self._fit()
        return self._coef

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
        guesses = [
            (x, seconds, weight * GUESS_WEIGHT_BESIDE_PROFILE)
            for x, seconds, weight in (*_GUESSES, *_SLOPE_CHANGES)
        ]
        profile = [(_features(t, d), seconds, PROFILE_WEIGHT) for t, d, seconds in kept]
        self._prior = _normal_sums(guesses + list(_NO_DRAFT_COST) + profile)
        self.num_profiled = len(kept)
        self.max_profiled_tokens = max(t for t, _, _ in kept)
        self._coef, self._stale = (), True  # the prior changed: no earlier fit holds

    def observe(self, num_tokens: int, num_draft_tokens: int, seconds: float) -> None:
        # The first step sets the scale where no profile did, whatever the guesses said, and a
        # first step larger than any the profile timed (a long prefill) is not clipped by an
        # extrapolation either. From then on one slow step (a first run of new shapes, a grammar
        # compiled before its first mask, a pause) counts as at most MAX_SURPRISE times the
        # prediction, so it cannot stop drafting for long: with few sizes measured, one such step
        # would bend the curve between them. A real change of speed gets there in a few steps.
        # The last fit's prediction decides whether to clip; only a step it would clip pays for
        # a refit (one per step would cost a step at one row ~2 ms of Python: more than the
        # policy saves), and is clipped by the refit's prediction.
        x = _features(num_tokens, num_draft_tokens)
        if self.num_observed >= 1 or num_tokens <= self.max_profiled_tokens:
            last = self._coef or self.coef
            if seconds > MAX_SURPRISE * _dot(last, x):
                seconds = min(seconds, MAX_SURPRISE * _dot(self.coef, x))
        for i in range(_NUM_FEATURES):
            self._xty[i] = self.decay * self._xty[i] + x[i] * seconds
            for j in range(_NUM_FEATURES):
                self._xtx[i][j] = self.decay * self._xtx[i][j] + x[i] * x[j]
        self.num_observed += 1
        self._stale = True

    def seconds(self, num_tokens: int, num_draft_tokens: int = 0) -> float:
        return _dot(self.coef, _features(num_tokens, num_draft_tokens))

    def seconds_with_drafts(self, num_tokens: int, num_draft_tokens: int, max_more: int) -> list[float]:
        """``seconds(num_tokens + m, num_draft_tokens + m)`` for m = 0..max_more, each from the
        one before (a plan's policy weighs every count of drafted tokens: O(1) each)."""
        _, *slopes, draft = self.coef
        stretch = sum(1 for knot in KNOTS if knot < num_tokens)  # the stretch of the step's last token
        times = [self.seconds(num_tokens, num_draft_tokens)]
        for n in range(num_tokens + 1, num_tokens + max_more + 1):
            if stretch < len(KNOTS) and KNOTS[stretch] < n:  # token n is past a knot: the next stretch
                stretch += 1
            times.append(times[-1] + slopes[stretch] + draft)
        return times

    def _fit(self) -> None:
        prior_xtx, prior_xty = self._prior
        xtx = [
            [a + b for a, b in zip(row, prior, strict=True)]
            for row, prior in zip(self._xtx, prior_xtx, strict=True)
        ]
        xty = [a + b for a, b in zip(self._xty, prior_xty, strict=True)]
        # More work never takes less time (noise can fit a negative slope): the slopes and d are
        # bounded in the fit; and a step costs something.
        (base, *rest), self._free = _nonnegative_solve(xtx, xty, _BOUNDED, self._free)
        self._coef = (max(base, 1e-6), *rest)
        self._stale = False
