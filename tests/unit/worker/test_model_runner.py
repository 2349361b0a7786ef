"""The paged, batched engine (scheduler core + ModelRunner) vs a plain unpaged forward, in fp32 on a
tiny random-weight model: mixed batches, chunked prefill, preemption, overlap, n, seeds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.local_engine import LocalEngine
from libs.models.llama import LlamaForCausalLM
from libs.protocol.codec import pack_tokens
from libs.protocol.messages import NewSequence, SamplingParams, SchedulerOutput
from services.scheduler.worker_scheduler import Limits
from services.worker.model_runner import ModelRunner, ModelShape, PlanError
from tests.reference import reference_greedy
from tests.tiny_models import TINY_LLAMA

CONFIG = TINY_LLAMA
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = {
    "a": [5, 9, 3, 7, 1, 2, 8],
    "b": [4, 4, 6],
    "c": [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29],
    "d": [30],
}
ARRIVALS = {"a": 0, "b": 2, "c": 3, "d": 5}


def make_runner(model: LlamaForCausalLM, num_blocks: int = 64, block_size: int = 4) -> ModelRunner:
    return ModelRunner(model, ModelShape.of(CONFIG), num_blocks, block_size, torch.float32)


def make_engine(
    model: LlamaForCausalLM,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 256,
    overlap: bool = False,
) -> LocalEngine:
    limits = Limits(
        num_blocks, block_size, 8, CONFIG.max_position_embeddings, max_num_batched_tokens, 64, 0.0
    )
    return LocalEngine(
        make_runner(model, num_blocks, block_size), limits, CONFIG.eos_token_id, overlap, check=True
    )


def run_staggered(engine: LocalEngine, params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    return engine.run((ARRIVALS[s], s, p, params) for s, p in PROMPTS.items())


@pytest.mark.parametrize(
    ("max_num_batched_tokens", "overlap"), [(256, False), (256, True), (5, False), (5, True)]
)
def test_staggered_batches_match_the_unpaged_reference(
    model: LlamaForCausalLM, max_num_batched_tokens: int, overlap: bool
) -> None:
    """Arrivals mid-flight mix prefills (chunked when the budget is 5) with decodes of every length."""
    engine = make_engine(model, max_num_batched_tokens=max_num_batched_tokens, overlap=overlap)
    outputs = run_staggered(engine)
    for seq_id, prompt in PROMPTS.items():
        assert outputs[seq_id] == reference_greedy(model, prompt, GREEDY.max_tokens), seq_id


def test_preempted_sequences_resume_to_the_same_output(model: LlamaForCausalLM) -> None:
    engine = make_engine(model, num_blocks=12, block_size=4)  # 48 slots for ~70 tokens of demand
    outputs = run_staggered(engine)
    assert engine.core.block_manager.num_free_blocks == 12
    assert engine.num_preemptions > 0
    for seq_id, prompt in PROMPTS.items():
        assert outputs[seq_id] == reference_greedy(model, prompt, GREEDY.max_tokens), seq_id


def test_choices_share_the_prompt_and_each_match_the_reference(model: LlamaForCausalLM) -> None:
    engine = make_engine(model)
    prompt = PROMPTS["c"]
    outputs = engine.run([(0, "r", prompt, dataclasses.replace(GREEDY, n=3))])
    want = reference_greedy(model, prompt, GREEDY.max_tokens)
    assert outputs == {"r": want, "r#1": want, "r#2": want}


def test_seeded_sampling_is_reproducible_across_batching_and_preemption(model: LlamaForCausalLM) -> None:
    # The random tiny model's logits span ~85, so a high temperature is what makes draws vary.
    params = SamplingParams(temperature=30.0, top_p=0.95, max_tokens=12, ignore_eos=True, seed=123)
    alone = make_engine(model).run([(0, "a", PROMPTS["a"], params)])["a"]
    crowded = run_staggered(make_engine(model, num_blocks=12, max_num_batched_tokens=5, overlap=True), params)
    assert crowded["a"] == alone
    other_seed = dataclasses.replace(params, seed=7)
    assert make_engine(model).run([(0, "a", PROMPTS["a"], other_seed)])["a"] != alone


def test_a_plan_that_contradicts_the_worker_is_refused(model: LlamaForCausalLM) -> None:
    runner = make_runner(model, num_blocks=4)
    new = NewSequence("a", pack_tokens([1, 2, 3]), b"", GREEDY, (2,), pack_tokens([0]), 0, 3)
    runner.execute(SchedulerOutput(1, (new,)))
    runner.check_integrity()
    with pytest.raises(PlanError):  # a decode for a sequence the worker never saw
        runner.execute(
            SchedulerOutput(2, seq_ids=("zzz",), num_scheduled_tokens=pack_tokens([1]), new_block_ids=(b"",))
        )
    with pytest.raises(PlanError):  # more tokens than the sequence has
        runner.execute(
            SchedulerOutput(3, seq_ids=("a",), num_scheduled_tokens=pack_tokens([2]), new_block_ids=(b"",))
        )
    with pytest.raises(PlanError):  # a block beyond the pool
        bad = NewSequence("b", pack_tokens([1] * 5), b"", GREEDY, (2,), pack_tokens([1, 9]), 0, 5)
        runner.execute(SchedulerOutput(4, (bad,)))
    assert "b" not in runner.seqs
    with pytest.raises(PlanError):  # a block beyond the pool, added to a held sequence
        runner.execute(
            SchedulerOutput(
                5, seq_ids=("a",), num_scheduled_tokens=pack_tokens([1]), new_block_ids=(pack_tokens([9]),)
            )
        )
    assert runner.seqs["a"].block_table == [0]
