"""The adaptive verification policy: acceptance estimates from counts, the step-time fit, the
verified lengths against an exhaustive search, and the core cutting a plan's drafts to them."""

from __future__ import annotations

import itertools
import random

import pytest

from libs.protocol.codec import unpack_tokens
from libs.protocol.messages import SamplingParams
from services.scheduler.sequence import Sequence
from services.scheduler.spec_policy import (
    HALVE_AT,
    AcceptancePredictor,
    VerifyPolicy,
    verify_lengths,
)
from services.scheduler.step_time import StepTimeModel
from services.scheduler.worker_scheduler import Limits, WorkerScheduler
from tests.unit.scheduler.test_step_time import curve

EOS = 2


def fitted(base: float, slope: float, draft: float = 0.0, flat_until: int = 1) -> StepTimeModel:
    """A model fitted to noiseless steps of ``base`` up to ``flat_until`` tokens, ``slope`` a token
    after that, and ``draft`` more a drafted token."""
    return curve(base, slope, flat_until, draft)


def test_drafts_pay_where_the_step_is_flat() -> None:
    # One decode 50 ms, up to 4 tokens no dearer, then 6 ms a token (a CPU at one row).
    model = fitted(0.05, 0.006, flat_until=4)
    assert verify_lengths([[0.5] * 5], 1, 1, model) == [3]  # 3 tokens for free; not the 4th
    assert verify_lengths([[0.95] * 5], 1, 1, model) == [5]  # ~4.1 tokens: worth the 6 ms each
    # Beside four decodes the step is no longer flat: the weak draft does not pay, a strong one does.
    assert verify_lengths([[0.3] * 5], 4, 4, model) == [0]
    assert verify_lengths([[0.95] * 5] * 4, 4, 4, model) == [5] * 4


def test_acceptance_estimates_follow_position_match_length_and_the_sequence() -> None:
    predictor = AcceptancePredictor()
    assert predictor.probabilities("s", "ngram", 3, 2) == [0.5, 0.5]  # the prior
    for i in range(200):  # the first drafted token always holds, the second never
        predictor.record(f"x{i % 3}", "ngram", 3, num_verified=3, num_accepted=1)
    p1, p2, p3 = predictor.probabilities("new", "ngram", 3, 3)
    assert p1 > 0.95 and p2 < 0.05 and p3 < 0.05  # never reached: starts from the one before
    # Another match length starts from the per-position estimate; another source from the prior.
    assert predictor.probabilities("new", "ngram", 2, 1)[0] > 0.9
    assert predictor.probabilities("new", "prediction", 3, 1) == [0.5]
    # A sequence's own record pulls its estimate: this one keeps being accepted whole.
    for _ in range(20):
        predictor.record("copier", "ngram", 3, num_verified=3, num_accepted=3)
    assert (
        predictor.probabilities("copier", "ngram", 3, 2)[1]
        > 0.5
        > predictor.probabilities("x0", "ngram", 3, 2)[1]
    )
    predictor.check_integrity({"x0", "x1", "x2", "copier"})
    predictor.forget("copier")
    with pytest.raises(AssertionError):
        predictor.check_integrity({"copier"})


def test_match_lengths_in_one_bucket_share_their_counts() -> None:
    predictor = AcceptancePredictor()
    for _ in range(100):
        predictor.record("y", "ngram", 20, num_verified=1, num_accepted=0)  # 17+: never holds
        predictor.record("y", "ngram", 10, num_verified=1, num_accepted=1)  # 9-16: always
        predictor.record("y", "prediction", 0, num_verified=1, num_accepted=1)  # before any output
        predictor.record("y", "prediction", 1, num_verified=1, num_accepted=0)
    [at_30], [at_12], [at_8] = (predictor.probabilities("new", "ngram", n, 1) for n in (30, 12, 8))
    assert at_30 < 0.1 and at_12 > 0.9 and 0.3 < at_8 < 0.7  # 5-8 has no counts: the position's
    [at_0], [at_1] = (predictor.probabilities("new", "prediction", n, 1) for n in (0, 1))
    assert at_0 > 0.9 and at_1 < 0.1


def test_counts_halve_so_the_estimate_follows_a_change() -> None:
    predictor = AcceptancePredictor()
    for _ in range(int(HALVE_AT) * 2):
        predictor.record("s", "ngram", 2, num_verified=1, num_accepted=1)
    for _ in range(int(HALVE_AT) // 2):
        predictor.record("s", "ngram", 2, num_verified=1, num_accepted=0)
    assert predictor.probabilities("t", "ngram", 2, 1)[0] < 0.6  # not the 0.8 that all-time counts give
    predictor.check_integrity({"s"})


def expected_rate(
    rates: list[list[float]], lengths: tuple[int, ...], base: tuple[int, int], model: StepTimeModel
) -> float:
    num_sampling, num_tokens = base
    gain = 0.0
    for r, k in zip(rates, lengths, strict=True):
        reach = 1.0
        for p in r[:k]:
            reach *= p
            gain += reach
    seconds = model.seconds(num_tokens + sum(lengths), sum(lengths))
    return (num_sampling + gain) / seconds


@pytest.mark.parametrize("seed", range(40))
def test_verified_lengths_are_the_best_of_every_choice(seed: int) -> None:
    rng = random.Random(seed)
    flat_until = rng.choice([1, 2, 4, 8])
    model = fitted(rng.uniform(0.005, 0.06), rng.uniform(1e-4, 4e-3), rng.uniform(0, 3e-3), flat_until)
    rates = [[rng.random() for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 3))]
    base = (len(rates) + rng.randint(0, 8), len(rates) + rng.randint(0, 200))
    lengths = verify_lengths(rates, *base, model)
    best = max(
        expected_rate(rates, choice, base, model)
        for choice in itertools.product(*(range(len(r) + 1) for r in rates))
    )
    assert expected_rate(rates, tuple(lengths), base, model) == pytest.approx(best, rel=1e-9)


def test_drafts_pay_alone_and_not_in_a_long_step() -> None:
    model = fitted(0.05, 0.001)  # a decode costs 50 drafted tokens' worth
    assert verify_lengths([[0.6] * 5], 1, 1, model) == [5]
    assert verify_lengths([[0.6] * 5, [0.02] * 5], 2, 2, model) == [5, 0]  # a prefix per sequence
    # Where tokens cost most of a step (64 decodes), a draft accepted at 0.3 does not pay ...
    crowded = fitted(0.01, 0.001, 0.001)
    assert verify_lengths([[0.3] * 5] * 8, 64, 64, crowded) == [0] * 8
    # ... alone it does; and beside a long prefill chunk, which makes every token cheap
    assert verify_lengths([[0.3] * 5], 1, 1, crowded)[0] > 0
    assert verify_lengths([[0.3] * 5], 1, 1 + 2048, crowded) == [5]


def test_the_policy_and_its_bookkeeping() -> None:
    policy = VerifyPolicy("adaptive", step_time=fitted(0.01, 0.001, 0.05))  # a drafted token is dear
    drafts = [("s", "ngram", 2, 4)]
    assert policy.lengths(drafts, 1, 1) == [0]  # the prior's 0.5 does not pay 50 ms a token
    for _ in range(30):  # a sequence whose drafts hold, while drafted tokens are cheap
        policy.predictor.record("u", "ngram", 4, num_verified=4, num_accepted=4)
    policy.step_time = fitted(0.01, 0.001, 0.0)
    assert policy.lengths([("u", "ngram", 4, 4)], 1, 1) == [4]
    # A time that is no measurement is dropped.
    policy.planned(7, 10, 0)
    before = policy.step_time.num_observed
    policy.measured(7, float("inf"))
    assert policy.step_time.num_observed == before
    assert VerifyPolicy("fixed").lengths(drafts, 1, 1) == [4]
    with pytest.raises(ValueError, match="policy"):
        VerifyPolicy("sometimes")


def test_the_core_cuts_drafts_to_what_pays_and_lets_the_undrafted_overlap() -> None:
    limits = Limits(64, 4, 4, 128, 256, 16, 0.0, speculative_method="ngram", num_speculative_tokens=4)
    core = WorkerScheduler(limits)
    policy = core.speculator.policy
    policy.step_time = fitted(0.01, 0.0001, 0.0)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]  # a repeating prompt: n-gram drafts at once
    core.add(Sequence("s", "g", prompt, params, EOS))
    core.schedule()
    core.postprocess(("s",), [7])  # the prefill
    core.check_integrity()
    plan = core.schedule()
    assert [unpack_tokens(d) for d in plan.draft_token_ids] == [[8, 9, 5, 6]]  # cheap tokens: all of it
    core.postprocess(("s",), [8, 9, 5, 6, 7], num_sampled=[5])
    core.check_integrity()
    plan = core.schedule()
    assert [unpack_tokens(d) for d in plan.draft_token_ids] == [[8, 9, 5, 6]]  # cheap tokens: all of it
    core.postprocess(("s",), [8, 9, 5, 6, 7], num_sampled=[5])
    core.check_integrity()
    # Drafted tokens turn dear: the next draft is cut whole, and the sequence overlaps its next plan.
    policy.step_time = fitted(0.01, 0.001, 1.0)
    plan = core.schedule()
    assert plan.draft_token_ids == () and plan.seq_ids == ("s",)
    assert core.seqs["s"].draft_token_ids == []
    assert core.schedule().seq_ids == ("s",)  # the second plan in flight (overlap)
    core.check_integrity()
    core.postprocess(("s",), [8])
    core.postprocess(("s",), [9])
    core.check_integrity()
    # Step times come back by step id; the fit learns from them.
    before = policy.step_time.num_observed
    core.record_step_time(plan.step_id, 0.02)
    assert policy.step_time.num_observed == before + 1
    core.record_step_time(plan.step_id, 0.02)  # (a step's time counts once)
    assert policy.step_time.num_observed == before + 1


@pytest.mark.parametrize(("max_num_seqs", "num_verified"), [(1, 3), (2, 4)])
def test_drafts_are_priced_beside_the_prefill_that_can_join_the_step(
    max_num_seqs: int, num_verified: int
) -> None:
    """A waiting prompt makes the step long, and the drafts beside it cheap, only if it can be
    admitted: with ``max_num_seqs`` full it waits, and the decode is priced alone."""
    limits = Limits(
        64, 4, max_num_seqs, 128, 256, 16, 0.0, speculative_method="ngram", num_speculative_tokens=4
    )
    core = WorkerScheduler(limits)
    core.speculator.policy.step_time = fitted(0.05, 0.006, flat_until=4)  # flat to 4 tokens
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    core.add(Sequence("s", "g", [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], params, EOS))
    core.schedule()
    core.postprocess(("s",), [7])  # the prefill
    core.add(Sequence("w", "h", list(range(100, 164)), params, EOS))  # 64 tokens, waiting
    plan = core.schedule()
    # the draft [8, 9, 5, 6] at the prior's 0.5 a position: alone the 4th token is not worth its
    # 6 ms; beside the 64-token prefill the step is long anyway
    assert [len(unpack_tokens(d)) for d in plan.draft_token_ids] == [num_verified]
    assert ("w" in {s.seq_id for s in plan.new_seqs}) == (max_num_seqs == 2)
    core.check_integrity()


def test_a_cut_draft_is_scored_against_the_tokens_that_came_instead() -> None:
    """The worker accepts a drafted token exactly when it equals its own sample there, so the
    tokens decoded after a draft the policy cut tell what verifying it would have accepted: the
    counts learn that as if it had been verified, once those tokens settle it."""
    limits = Limits(64, 4, 4, 128, 256, 16, 0.0, speculative_method="ngram", num_speculative_tokens=4)
    core = WorkerScheduler(limits)
    policy = core.speculator.policy
    policy.step_time = fitted(0.01, 0.001, 1.0)  # drafts never pay: every one is cut
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    core.add(Sequence("s", "g", [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], params, EOS))
    core.schedule()
    core.postprocess(("s",), [7])  # the prefill
    plan = core.schedule()  # drafts [8, 9, 5, 6], cut whole
    assert plan.draft_token_ids == () and plan.seq_ids == ("s",)
    match_len = core.seqs["s"].draft_match_len

    def estimates(predictor: AcceptancePredictor) -> list[list[float]]:
        return [predictor.probabilities(s, "ngram", match_len, 4) for s in ("s", "another")]

    untouched = estimates(AcceptancePredictor())
    for token_id in (8, 9):  # each as the draft had it: not settled yet
        core.postprocess(("s",), [token_id])
        core.schedule()  # (its drafts are cut too; the first stays the one scored)
        core.check_integrity()
        assert estimates(policy.predictor) == untouched
    core.postprocess(("s",), [7])  # the draft's third token did not come: two would have held
    core.schedule()
    core.check_integrity()
    expected = AcceptancePredictor()
    expected.record("s", "ngram", match_len, num_verified=4, num_accepted=2)
    assert estimates(policy.predictor) == estimates(expected) != untouched
