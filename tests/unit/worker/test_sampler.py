"""Sampler behaviour: greedy, filters, penalties, min_tokens, seeds, logprobs and the distribution."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from libs.kernels.sampling import sample_ref, uniform_from_seed
from libs.protocol.codec import unpack_floats, unpack_tokens
from libs.protocol.messages import SamplingParams, TokenBias
from services.worker.sampler import Sampler
from services.worker.sequence_state import SequenceState

GREEDY = SamplingParams(temperature=0.0)


def make_seq(
    params: SamplingParams,
    prompt: tuple[int, ...] = (5, 6),
    outputs: tuple[int, ...] = (),
    stop_token_ids: frozenset[int] = frozenset(),
) -> SequenceState:
    return SequenceState(
        seq_id="s",
        token_ids=[*prompt, *outputs],
        num_prompt_tokens=len(prompt),
        sampling_params=params,
        stop_token_ids=stop_token_ids,
        block_table=[],
        num_computed_tokens=0,
    )


def random_logits(num_rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    kept = expected > 0
    assert int(counts[~kept].sum()) == 0, "drew a token of probability 0"
    return float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())


# --- greedy and filters ---------------------------------------------------------------------


def test_all_greedy_batch_is_argmax_without_logprobs() -> None:
    logits = random_logits(9, 300, seed=0)
    out = Sampler(seed=0)(logits.clone(), [make_seq(GREEDY) for _ in range(9)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 9


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1, temperature=1.5),
        SamplingParams(top_p=1e-6),
        SamplingParams(top_k=30, top_p=1e-6, temperature=0.3),
        SamplingParams(min_p=1.0),
        SamplingParams(temperature=1e-4),
    ],
)
def test_filters_that_keep_one_token_equal_greedy(params: SamplingParams) -> None:
    logits = random_logits(32, 1000, seed=1)
    seqs = [make_seq(dataclasses.replace(params, seed=None if i % 2 else i)) for i in range(32)]
    out = Sampler(seed=0)(logits.clone(), seqs)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_min_p_draws_only_tokens_above_min_p_times_the_top_prob() -> None:
    probs = torch.tensor([0.4, 0.25, 0.19, 0.1, 0.06])
    logits = probs.log().repeat(4000, 1)
    out = Sampler(seed=1)(logits, [make_seq(SamplingParams(min_p=0.5))] * 4000)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5)
    kept = torch.tensor([0.4, 0.25, 0.0, 0.0, 0.0]) / 0.65  # 0.19 < 0.5 * 0.4
    assert chi_square(counts, kept) < 11.0  # 1 dof: p ~ 1e-3


def test_top_k_and_top_p_draws_follow_the_renormalised_head() -> None:
    probs = torch.tensor([0.05, 0.3, 0.1, 0.35, 0.2])
    logits = probs.log().repeat(4000, 1)
    sampler = Sampler(seed=2)
    top3 = sampler(logits.clone(), [make_seq(SamplingParams(top_k=3))] * 4000)
    counts = torch.bincount(torch.tensor(top3.token_ids), minlength=5)
    assert chi_square(counts, torch.tensor([0.0, 0.3, 0.0, 0.35, 0.2]) / 0.85) < 14.0  # 2 dof
    # top_p 0.6: 0.35 + 0.3 reaches it; the 0.2 token is outside the nucleus
    nucleus = sampler(logits.clone(), [make_seq(SamplingParams(top_p=0.6))] * 4000)
    counts = torch.bincount(torch.tensor(nucleus.token_ids), minlength=5)
    assert chi_square(counts, torch.tensor([0.0, 0.3, 0.0, 0.35, 0.0]) / 0.65) < 11.0  # 1 dof


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_follows_the_softmax_at_the_temperature(temperature: float) -> None:
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -3.0, 1.5, 0.7, -1.0, 0.3])
    params = SamplingParams(temperature=temperature)
    sampler = Sampler(seed=3)
    counts = torch.zeros(10)
    for _ in range(5):
        out = sampler(logits.repeat(4000, 1), [make_seq(params)] * 4000)
        counts += torch.bincount(torch.tensor(out.token_ids), minlength=10)
    assert chi_square(counts, torch.softmax(logits / temperature, dim=-1)) < 33.0  # 9 dof: p ~ 1e-4


def test_seeded_draws_over_steps_follow_the_softmax() -> None:
    logits = torch.tensor([0.5, -1.0, 1.0, 0.0, 2.0, -0.5])
    params = SamplingParams(seed=1234)
    sampler = Sampler(seed=4)
    rows = [make_seq(params, outputs=(0,) * k) for k in range(3000)]  # steps 0..2999
    out = sampler(logits.repeat(3000, 1), rows)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=6)
    assert chi_square(counts, torch.softmax(logits, dim=-1)) < 21.0  # 5 dof: p ~ 1e-3


# --- penalties and min_tokens ---------------------------------------------------------------


def greedy_pick(
    logits: list[float], params: SamplingParams, prompt: tuple[int, ...], outputs: tuple[int, ...]
) -> int:
    seq = make_seq(dataclasses.replace(params, temperature=0.0), prompt, outputs)
    return Sampler(seed=0)(torch.tensor([logits]), [seq]).token_ids[0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    rep = SamplingParams(repetition_penalty=2.0)
    assert greedy_pick([3.0, 2.0, 1.0], rep, prompt=(1,), outputs=()) == 0  # token 0 not seen
    assert greedy_pick([3.0, 2.0, 1.0], rep, prompt=(0,), outputs=()) == 1  # 3 / 2 < 2: prompt counts
    assert greedy_pick([3.0, 2.0, 1.0], rep, prompt=(2,), outputs=(0,)) == 1  # outputs count too
    assert greedy_pick([-1.0, -1.5, -9.0], rep, prompt=(2,), outputs=(0,)) == 1  # -1 * 2 < -1.5
    assert (
        greedy_pick([-1.0, -1.5, -9.0], SamplingParams(repetition_penalty=1.4), (2,), (0,)) == 0
    )  # -1.4 > -1.5


def test_presence_and_frequency_penalise_output_tokens_only_by_count() -> None:
    presence = SamplingParams(presence_penalty=5.0)
    assert greedy_pick([2.0, 1.0], presence, prompt=(0,), outputs=()) == 0  # prompt tokens are exempt
    assert greedy_pick([2.0, 1.0], presence, prompt=(1,), outputs=(0,)) == 1
    frequency = SamplingParams(frequency_penalty=0.6)
    assert greedy_pick([2.0, 1.0], frequency, prompt=(1,), outputs=(0,)) == 0  # 2 - 0.6 > 1
    assert greedy_pick([2.0, 1.0], frequency, prompt=(1,), outputs=(0, 0)) == 1  # 2 - 2 * 0.6 < 1
    once = SamplingParams(presence_penalty=0.6)
    assert greedy_pick([2.0, 1.0], once, prompt=(1,), outputs=(0, 0, 0)) == 0  # presence counts once


def test_repetition_penalty_applies_before_presence() -> None:
    # repetition then presence: 4 / 2 - 1 = 1.0 < 1.2; the other order would give (4 - 1) / 2 = 1.5
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0)
    assert greedy_pick([4.0, 1.2, -9.0], params, prompt=(2,), outputs=(0,)) == 1


def test_logit_bias_is_added_to_the_logits_before_the_penalties() -> None:
    def bias(*entries: tuple[int, float]) -> SamplingParams:
        return SamplingParams(logit_bias=tuple(TokenBias(t, b) for t, b in entries))

    assert greedy_pick([3.0, 2.0, 1.0], bias((2, 5.0)), prompt=(9,), outputs=()) == 2  # forced
    assert greedy_pick([3.0, 2.0, 1.0], bias((0, -100.0)), prompt=(9,), outputs=()) == 1  # banned
    assert greedy_pick([3.0, 2.0, 1.0], bias((0, -0.5), (1, 0.6)), prompt=(9,), outputs=()) == 1
    assert greedy_pick([3.0, 2.0, 1.0], bias((7, 100.0)), prompt=(9,), outputs=()) == 0  # no such token
    # bias then repetition penalty: (2 + 1) / 2 = 1.5 < 1.6; the other order would give 2 / 2 + 1 = 2
    both = dataclasses.replace(bias((0, 1.0)), repetition_penalty=2.0)
    assert greedy_pick([2.0, 1.6, -9.0], both, prompt=(0,), outputs=()) == 1
    # the logprobs stay those of the raw logits
    params = dataclasses.replace(bias((1, 50.0)), temperature=0.0, logprobs=True)
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    out = Sampler(seed=0)(logits.clone(), [make_seq(params)])
    assert out.token_ids == [1]
    assert out.logprobs[0] is not None
    raw = torch.log_softmax(logits[0], dim=-1)[1].item()
    assert unpack_floats(out.logprobs[0].token_logprobs)[0] == pytest.approx(raw, abs=1e-6)


def test_min_tokens_masks_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]])  # stop tokens 1 and 3 lead
    stops = frozenset({1, 3})
    for num_outputs, expected in [(0, 2), (2, 2), (3, 1), (7, 1)]:
        params = SamplingParams(temperature=0.0, min_tokens=3)
        seq = make_seq(params, outputs=(0,) * num_outputs, stop_token_ids=stops)
        assert Sampler(seed=0)(logits.clone(), [seq]).token_ids == [expected]


def test_min_tokens_mask_holds_for_sampled_rows_and_only_their_own_stops() -> None:
    logits = torch.tensor([3.0, 2.5, 2.0, 0.0]).repeat(600, 1)
    masked = make_seq(SamplingParams(min_tokens=1), stop_token_ids=frozenset({0, 1}))
    free = make_seq(SamplingParams(min_tokens=1), outputs=(2,), stop_token_ids=frozenset({0, 1}))
    out = Sampler(seed=5)(logits, [masked, free] * 300)
    assert set(out.token_ids[0::2]) == {2, 3}
    assert {0, 1} <= set(out.token_ids[1::2])


# --- seeds ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(seed=11),
        SamplingParams(seed=12, top_k=50),
        SamplingParams(seed=13, top_p=0.9, temperature=1.2),
    ],
)
def test_seeded_row_ignores_neighbours_position_and_sampler(params: SamplingParams) -> None:
    vocab = 2000
    neighbours = [
        GREEDY,
        SamplingParams(),
        SamplingParams(top_k=3, seed=99),
        SamplingParams(top_p=0.5, logprobs=True, top_logprobs=2),
        SamplingParams(min_p=0.2, repetition_penalty=1.3),
    ]
    for step in range(6):
        row = random_logits(1, vocab, seed=100 + step, scale=1.0)
        seq = make_seq(params, outputs=(7,) * step)
        alone = Sampler(seed=1)(row.clone(), [seq]).token_ids[0]
        for position in (0, 3, 5):
            others = random_logits(5, vocab, seed=step)
            batch = torch.cat([others[:position], row, others[position:]])
            seqs = [make_seq(p) for p in neighbours]
            seqs.insert(position, seq)
            assert Sampler(seed=position)(batch, seqs).token_ids[position] == alone


def test_seeded_draws_differ_across_steps_and_seeds() -> None:
    logits = torch.zeros(1000, 500)  # uniform over 500 tokens
    by_step = Sampler()(
        logits.clone(), [make_seq(SamplingParams(seed=5), outputs=(1,) * k) for k in range(1000)]
    )
    by_seed = Sampler()(
        logits.clone(), [make_seq(SamplingParams(seed=s), outputs=(1,) * 4) for s in range(1000)]
    )
    for tokens in (by_step.token_ids, by_seed.token_ids):
        # 1000 independent uniform draws over 500 tokens hit about 432 distinct ones
        assert 380 < len(set(tokens)) < 480
    assert by_step.token_ids != by_seed.token_ids


def test_unseeded_rows_use_the_sampler_seed() -> None:
    logits = random_logits(64, 300, seed=6, scale=1.0)
    seqs = [make_seq(SamplingParams()) for _ in range(64)]
    first, again, other = (
        Sampler(seed=8)(logits.clone(), seqs),
        Sampler(seed=8)(logits.clone(), seqs),
        Sampler(seed=9)(logits.clone(), seqs),
    )
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids


# --- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_logits_with_sorted_alternatives() -> None:
    vocab = 400
    logits = random_logits(4, vocab, seed=7)
    params = [
        SamplingParams(logprobs=True, top_logprobs=5, temperature=0.7, repetition_penalty=1.5, top_k=20),
        GREEDY,
        SamplingParams(temperature=0.0, logprobs=True, frequency_penalty=2.0),
        SamplingParams(logprobs=True, top_logprobs=2, min_p=0.1, seed=3),
    ]
    seqs = [make_seq(p, prompt=(1, 2), outputs=(3, 4, 3)) for p in params]
    out = Sampler(seed=0)(logits.clone(), seqs)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    for i, num_top in [(0, 5), (2, 0), (3, 2)]:
        lp = out.logprobs[i]
        assert lp is not None and lp.num_top == num_top
        (token_logprob,) = unpack_floats(lp.token_logprobs)
        assert token_logprob == pytest.approx(float(raw[i, out.token_ids[i]]), abs=1e-5)
        top_values, top_ids = raw[i].topk(num_top)
        assert unpack_tokens(lp.top_token_ids) == top_ids.tolist()
        assert unpack_floats(lp.top_logprobs) == pytest.approx(top_values.tolist(), abs=1e-5)
        assert unpack_floats(lp.top_logprobs) == sorted(unpack_floats(lp.top_logprobs), reverse=True)


# --- mixed batches --------------------------------------------------------------------------


def test_mixed_batch_matches_the_plain_reference() -> None:
    vocab = 3000
    kinds = [
        GREEDY,
        SamplingParams(temperature=0.0, repetition_penalty=1.2, min_tokens=4),
        SamplingParams(temperature=0.9),
        SamplingParams(top_k=40, top_p=0.9, min_p=0.02),
        SamplingParams(top_p=0.3, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(top_p=0.95, temperature=1.5),
        SamplingParams(top_k=1500, repetition_penalty=0.8, logprobs=True, top_logprobs=3),
        SamplingParams(min_p=0.1, temperature=0.6, min_tokens=9),
        SamplingParams(temperature=0.0, logit_bias=(TokenBias(5, 4.0), TokenBias(2999, -100.0))),
        SamplingParams(top_p=0.9, logit_bias=tuple(TokenBias(t, 3.0) for t in range(0, 3000, 7))),
    ]
    seqs = []
    for i in range(24):
        params = dataclasses.replace(
            kinds[i % len(kinds)], seed=None if kinds[i % len(kinds)].greedy else 1000 + i
        )
        outputs = tuple(range(i % 5, 40 + i % 5, 3))[: i % 11]
        seqs.append(make_seq(params, prompt=(9, 1, 9, 2), outputs=outputs, stop_token_ids=frozenset({0, 1})))
    logits = random_logits(24, vocab, seed=8, scale=1.5)
    uniforms = torch.tensor(
        [uniform_from_seed(s.sampling_params.seed or 0, s.num_output_tokens) for s in seqs],
        dtype=torch.float64,
    )
    expected = sample_ref(logits, seqs, uniforms).tolist()
    out = Sampler()(logits.clone(), seqs)
    assert out.token_ids == expected
    assert [lp is not None for lp in out.logprobs] == [s.sampling_params.logprobs for s in seqs]
