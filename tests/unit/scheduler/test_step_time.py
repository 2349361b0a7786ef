"""The step-time model: a piecewise-linear fit of step seconds to tokens and drafted tokens, from
measured steps, a start-up profile or guesses."""

from __future__ import annotations

import itertools
import random

import pytest

from services.scheduler.step_time import KNOTS, StepTimeModel

# Token counts a worker's steps have: decodes of 1-64 rows with drafts, prefill chunks.
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 100, 128, 200, 256, 400, 512, 700)


def curve(base: float, slope: float, flat_until: int = 1, draft: float = 0.0) -> StepTimeModel:
    """A model fitted to noiseless steps taking ``base`` up to ``flat_until`` tokens, ``slope`` a
    token after that, and ``draft`` more a drafted token."""
    model = StepTimeModel()
    for _ in range(3):
        for num_tokens in SIZES:
            for drafted in {0, num_tokens // 2}:
                seconds = base + slope * max(0, num_tokens - flat_until) + draft * drafted
                model.observe(num_tokens, drafted, seconds)
    return model


@pytest.mark.parametrize("flat_until", [1, 4, 8])
def test_the_fit_finds_a_flat_stretch_and_the_slope_after_it(flat_until: int) -> None:
    model = curve(0.05, 0.002, flat_until, draft=0.001)
    for num_tokens in (1, 2, 3, 4, 5, 8, 9, 16, 33, 100, 600):
        expected = 0.05 + 0.002 * max(0, num_tokens - flat_until)
        assert model.seconds(num_tokens) == pytest.approx(expected, rel=0.02, abs=5e-4), num_tokens
        assert model.seconds(num_tokens, 3) == pytest.approx(expected + 0.003, rel=0.02, abs=5e-4)


def test_before_any_step_a_straight_line_and_free_drafts() -> None:
    model = StepTimeModel()
    base, *slopes, draft = model.coef
    assert len(slopes) == len(KNOTS) + 1
    slope = slopes[0]
    assert base > 0 and slope > 0 and draft == 0
    assert slopes == pytest.approx([slope] * len(slopes))  # one straight line
    assert base == pytest.approx(40 * slope)  # a decode costs about as much as 40 tokens
    # One long prefill is enough for a sensible split of a decode's cost from a token's.
    model.observe(520, 0, 0.8)
    assert 0.02 < model.coef[0] < 0.2
    assert model.seconds(520) == pytest.approx(0.8, rel=0.05)


def test_newer_steps_outweigh_older_ones() -> None:
    model = curve(0.05, 0.001)
    for _ in range(300):  # the machine got twice as slow
        for num_tokens in SIZES:
            model.observe(num_tokens, 0, 2 * (0.05 + 0.001 * (num_tokens - 1)))
    assert model.seconds(1) == pytest.approx(0.1, rel=0.05)
    assert model.seconds(300) == pytest.approx(2 * (0.05 + 0.299), rel=0.05)


def test_the_curve_never_falls() -> None:
    """Noisy steps can fit a negative slope somewhere; the model keeps every stretch's slope and a
    drafted token's cost >= 0, so more tokens or drafts never predict a faster step."""
    rng = random.Random(0)
    model = StepTimeModel()
    for _ in range(200):
        num_tokens = rng.choice(SIZES)
        drafted = rng.randint(0, num_tokens - 1)
        # Slower at 12 tokens than at 16 (as a BLAS can be), and very noisy.
        seconds = (0.08 if num_tokens == 12 else 0.05) * rng.uniform(0.5, 1.5) + 0.0002 * num_tokens
        model.observe(num_tokens, drafted, seconds)
    times = [model.seconds(t) for t in range(1, 800)]
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(times))
    assert model.coef[-1] >= 0 and model.coef[0] > 0


def test_a_start_up_profile_sets_the_fit_before_any_step() -> None:
    # The shapes services/worker/step_profile.py times: 1 and 8 rows, drafts of 1, 3 and 7 a row.
    def truth(t: int, d: int) -> float:  # flat to 4 tokens, 3 ms a token to 16, 2 ms after
        return 0.05 + 0.003 * min(max(0, t - 4), 12) + 0.002 * max(0, t - 16) + 0.0005 * d

    shapes = [(1, 0, 0), (2, 1, 1), (4, 3, 1), (8, 7, 1), (8, 0, 0), (16, 8, 8), (32, 24, 8), (64, 56, 8)]
    model = StepTimeModel()
    model.profiled([(t, d, r, truth(t, d)) for t, d, r in shapes])
    assert model.num_profiled == 8 and model.num_observed == 0 and model.max_profiled_tokens == 64
    for t, d in [(1, 0), (3, 2), (4, 0), (6, 5), (12, 0), (16, 0), (48, 40), (64, 56)]:
        assert model.seconds(t, d) == pytest.approx(truth(t, d), rel=0.05), (t, d)
    # Measured steps outweigh it in time (the machine got slower) ...
    for _ in range(200):
        for t, d, _ in shapes:
            model.observe(t, d, 1.5 * truth(t, d))
    assert model.seconds(8) == pytest.approx(1.5 * truth(8, 0), rel=0.05)
    # ... and with a profile, a surprise is clipped from the first measured step on, within the
    # sizes the profile timed; a first longer step (a prefill) is not judged by an extrapolation.
    fresh = StepTimeModel()
    fresh.profiled([(t, d, r, truth(t, d)) for t, d, r in shapes])
    before = fresh.seconds(2048)
    fresh.observe(2048, 0, 10 * before)
    assert fresh.seconds(2048) > 3 * before
    fresh.observe(1, 0, 100.0)
    assert fresh.seconds(1) < 0.2
    # Without a profile only the first step goes unclipped: it sets the scale. A slow one later
    # (a grammar compiled before its first mask) counts as twice the prediction at most; a real
    # change of speed is followed within a few steps.
    model = StepTimeModel()
    for num_tokens in (31, 35, 38, 4, 4, 3):
        model.observe(num_tokens, 0, 20 * truth(num_tokens, 0) if num_tokens == 38 else truth(num_tokens, 0))
    assert model.seconds(38) < 3 * truth(38, 0)
    for _ in range(20):
        model.observe(4, 0, 3 * truth(4, 0))
    assert model.seconds(4) == pytest.approx(3 * truth(4, 0), rel=0.1)
    # A sample that is no measurement, or no step, is left out; none at all keeps the guesses.
    unprofiled = StepTimeModel()
    not_steps = [(1, 0, 0, float("nan")), (4, 5, 1, 0.1), (2, 0, 0, -1.0), (5, 3, 0, 0.1), (5, 0, 1, 0.1)]
    unprofiled.profiled([*not_steps, (0, 0, 0, 0.1), (3, 3, 1, 0.1)])
    assert unprofiled.num_profiled == 0 and unprofiled.coef == StepTimeModel().coef


# Profiles measured on a busy machine, as (tokens, drafted, drafted rows, ms): 2 tokens faster
# than 1, a drafted row of 8 tokens faster than 8 decodes (8 rows), 8 tokens dearer than 16 (4 rows).
NOISY_PROFILES = [
    [
        *[(1, 0, 0, 55.3), (8, 0, 0, 81.7), (2, 1, 1, 48.6), (16, 8, 8, 91.8), (4, 3, 1, 45.8)],
        *[(32, 24, 8, 125.6), (8, 7, 1, 77.6), (64, 56, 8, 205.4)],
    ],
    [
        *[(1, 0, 0, 57.7), (4, 0, 0, 58.8), (2, 1, 1, 59.6), (8, 4, 4, 109.9), (4, 3, 1, 43.9)],
        *[(16, 12, 4, 100.0), (8, 7, 1, 74.5), (32, 28, 4, 132.3)],
    ],
]


@pytest.mark.parametrize("profile", NOISY_PROFILES)
def test_a_noisy_profile_is_fitted_within_bounds_not_clipped_after(
    profile: list[tuple[int, int, int, float]],
) -> None:
    """An unbounded fit of these gives some slope and d below 0; raising them to 0 after the fact
    left the steep slopes fitted beside them, and predicted the largest step at 1.2 and 2.8 times
    its measured time. The bounded fit passes near every point it can reach."""
    model = StepTimeModel()
    model.profiled([(t, d, r, seconds / 1e3) for t, d, r, seconds in profile])
    _, *slopes, draft = model.coef
    assert min(slopes) >= 0 and draft >= 0
    largest = max(profile)
    assert model.seconds(largest[0], largest[1]) * 1e3 == pytest.approx(largest[3], rel=0.05)
    for t, d, _, seconds in profile:
        assert model.seconds(t, d) * 1e3 == pytest.approx(seconds, rel=0.3), (t, d)


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 8, 60, 511, 512, 513])
def test_the_times_of_every_count_of_drafts_are_the_models(num_tokens: int) -> None:
    model = curve(0.05, 0.002, flat_until=4, draft=0.0005)
    model.observe(64, 0, 0.3)  # a bend the curve did not have
    times = model.seconds_with_drafts(num_tokens, 2, 600)
    assert len(times) == 601
    for m, seconds in enumerate(times):
        assert seconds == pytest.approx(model.seconds(num_tokens + m, 2 + m), rel=1e-9, abs=1e-12), m


def test_a_fit_from_the_last_ones_free_variables_is_the_fit_from_none() -> None:
    """Each fit starts from the variables the fit before left off their bounds (one solve where
    the step moved none, a pass per variable from none): the answer is the same, step after step,
    through noisy steps that move slopes onto their bound and off it."""
    rng = random.Random(7)
    warm, cold = StepTimeModel(), StepTimeModel()
    for i in range(120):
        num_tokens = rng.choice(SIZES)
        drafted = rng.choice([0, num_tokens // 2])
        bend = 0.004 if i < 60 else 0.0  # a stretch whose slope goes to its bound halfway
        seconds = 0.01 + 0.0005 * num_tokens + bend * max(0, 8 - num_tokens) + rng.uniform(0, 0.004)
        for model in (warm, cold):
            model.observe(num_tokens, drafted, seconds)
        cold._free = None  # the fit from none, to compare with
        assert warm.coef == pytest.approx(cold.coef, rel=1e-7, abs=1e-10), i
