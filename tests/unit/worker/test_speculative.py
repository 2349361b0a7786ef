"""Speculative decoding through the real ModelRunner and scheduler core (tiny random llama, fp32):
n-gram drafts change no token, greedy or seeded, with overlap on and off, under preemption, with
logprobs, a logit bias and n > 1; every case checks that drafts were both accepted and rejected
in it.

The random model repeats its last token, which n-gram drafts predict once the output has two of
them; a prompt where that pair was followed by something else makes the first draft wrong."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.local_engine import LocalEngine
from libs.models.llama import LlamaForCausalLM
from libs.protocol.codec import unpack_floats, unpack_tokens
from libs.protocol.messages import FinishReason, SamplingParams, TokenBias
from services.scheduler.spec_policy import StepTimeModel
from services.scheduler.worker_scheduler import Limits
from services.worker.model_runner import ModelRunner, ModelShape
from tests.reference import reference_greedy
from tests.tiny_models import TINY_LLAMA

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True, seed=11)
PROMPTS = {
    "a": [5, 9, 3, 7, 1, 2, 8, 11, 5, 9, 3],
    "b": [40, 41, 42, 43, 40, 41],
    "c": [60, 61, 62, 63, 64, 65, 66, 67, 68],
    "d": [3, 3, 3, 3],
    # every run of 3s so far ended in 9: drafts say 9 until the output's own run is the longest
    "e": [3, 3, 9, 3, 3, 3, 9, 3, 3, 3, 3, 9, 3, 3, 3, 3, 3, 9, 7, 3],
    "f": [4, 4, 8, 4, 4, 4, 8, 4, 4, 4, 4, 8, 4, 4, 4, 4, 4, 8, 6, 4],
}


def make_engine(
    model: LlamaForCausalLM,
    num_speculative_tokens: int,
    overlap: bool = False,
    num_blocks: int = 96,
    max_num_seqs: int = 8,
    policy: str = "fixed",
) -> LocalEngine:
    limits = Limits(
        num_blocks,
        BLOCK_SIZE,
        max_num_seqs,
        TINY_LLAMA.max_position_embeddings,
        256,
        64,
        0.0,
        speculative_method="ngram" if num_speculative_tokens else "none",
        num_speculative_tokens=num_speculative_tokens,
        speculative_policy=policy,
    )
    runner = ModelRunner(model, ModelShape.of(TINY_LLAMA), num_blocks, BLOCK_SIZE, torch.float32)
    engine = LocalEngine(runner, limits, TINY_LLAMA.eos_token_id, overlap, check=True)
    if policy == "adaptive":  # decisions from acceptance alone: step times as the prior, not measured
        engine.core.speculator.policy.step_time = FrozenStepTime()
    return engine


class FrozenStepTime(StepTimeModel):
    """The prior step-time model, deaf to measured steps (so a test's drafts do not depend on the
    machine's speed)."""

    def observe(self, num_tokens: int, num_draft_tokens: int, seconds: float) -> None:
        pass


def serve(
    engine: LocalEngine, params: SamplingParams, prompts: dict[str, list[int]] = PROMPTS
) -> dict[str, list[int]]:
    return engine.run((i, seq_id, prompt, params) for i, (seq_id, prompt) in enumerate(prompts.items()))


def assert_drafts_accepted_and_rejected(engine: LocalEngine) -> None:
    stats = engine.core.speculator.stats["ngram"]
    assert 0 < stats.num_accepted < stats.num_drafted, stats


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("k", "policy"), [(1, "fixed"), (3, "fixed"), (5, "fixed"), (5, "adaptive")])
def test_greedy_tokens_are_those_without_speculation(
    model: LlamaForCausalLM, overlap: bool, k: int, policy: str
) -> None:
    plain = serve(make_engine(model, 0, overlap), GREEDY)
    engine = make_engine(model, k, overlap, policy=policy)
    assert serve(engine, GREEDY) == plain
    assert plain == {s: reference_greedy(model, p, GREEDY.max_tokens) for s, p in PROMPTS.items()}
    assert_drafts_accepted_and_rejected(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_seeded_samples_are_those_without_speculation(model: LlamaForCausalLM, overlap: bool) -> None:
    for prompts in (PROMPTS, {"e": PROMPTS["e"]}):  # in a batch and alone
        plain = serve(make_engine(model, 0, overlap), SEEDED, prompts)
        engine = make_engine(model, 4, overlap, policy="adaptive" if overlap else "fixed")
        assert serve(engine, SEEDED, prompts) == plain
        assert_drafts_accepted_and_rejected(engine)


@pytest.mark.parametrize("base", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_logit_bias_applies_at_every_verified_position(
    model: LlamaForCausalLM, base: SamplingParams
) -> None:
    # 3 and 40 banned, 9 favoured: the drafts the prompts suggest are often wrong now
    bias = (TokenBias(3, -100.0), TokenBias(9, 2.0), TokenBias(40, -100.0))
    params = dataclasses.replace(base, logit_bias=bias)
    plain = serve(make_engine(model, 0), params)
    assert plain != serve(make_engine(model, 0), base)  # the bias changes the output
    assert not any(t in (3, 40) for tokens in plain.values() for t in tokens)
    engine = make_engine(model, 4)
    assert serve(engine, params) == plain
    assert_drafts_accepted_and_rejected(engine)


def test_preemption_and_n_choices_keep_the_tokens(model: LlamaForCausalLM) -> None:
    params = dataclasses.replace(SEEDED, n=2)
    # 24 pages: preemptions, and drafts both accepted and rejected (with fewer, the sequences'
    # first decodes, whose drafts the prompts make wrong, happen to go undrafted)
    plain = serve(make_engine(model, 0, True, num_blocks=24), params)
    engine = make_engine(model, 4, True, num_blocks=24)
    assert serve(engine, params) == plain
    assert engine.num_preemptions > 0
    assert_drafts_accepted_and_rejected(engine)


def test_logprobs_are_those_without_speculation(model: LlamaForCausalLM) -> None:
    params = dataclasses.replace(GREEDY, logprobs=True, top_logprobs=3)
    engines = [make_engine(model, k, False) for k in (0, 4)]
    outputs = [serve(engine, params) for engine in engines]
    assert outputs[0] == outputs[1]
    for seq_id in PROMPTS:
        parts = [engine.finished[seq_id].unsent_logprobs for engine in engines]
        chosen = [[x for p in part for x in unpack_floats(p.token_logprobs)] for part in parts]
        top_ids = [[i for p in part for i in unpack_tokens(p.top_token_ids)] for part in parts]
        assert len(chosen[1]) == GREEDY.max_tokens
        assert chosen[1] == pytest.approx(chosen[0], abs=1e-4) and top_ids[1] == top_ids[0]
    assert_drafts_accepted_and_rejected(engines[1])


def test_a_predicted_token_outside_the_vocabulary_ends_the_draft_and_fails_nothing(
    model: LlamaForCausalLM,
) -> None:
    """A client's prediction may hold any id: the draft is verified up to it (never sampled)."""
    (seq_id, prompt), *_ = PROMPTS.items()
    plain = serve(make_engine(model, 0), GREEDY, {seq_id: prompt})[seq_id]
    engine = make_engine(model, 4)
    prediction = [*plain[:3], TINY_LLAMA.vocab_size, 2**32 - 1, *plain[3:]]
    engine.add(seq_id, prompt, GREEDY, prediction_token_ids=prediction)
    assert engine.run() == {seq_id: plain}
    seq = engine.finished[seq_id]
    assert seq.finish_reason is FinishReason.LENGTH
    assert seq.num_unsent_accepted_prediction_tokens > 0 and seq.num_unsent_rejected_prediction_tokens > 0
