"""The worker's start-up step profile: the shapes it times, what it leaves behind (nothing: the
runner holds no sequence and serves exactly afterwards), and when it cannot run."""

from __future__ import annotations

import torch

from deepinfer.local_engine import LocalEngine
from libs.models.llama import LlamaForCausalLM
from libs.protocol.member_messages import StepSample
from libs.protocol.messages import SamplingParams
from services.scheduler.worker_scheduler import Limits
from services.worker.model_runner import ModelRunner, ModelShape
from services.worker.step_profile import DRAFT_LENGTHS, profile_steps
from tests.reference import reference_greedy
from tests.tiny_models import TINY_LLAMA

BLOCK_SIZE = 4


def runner_of(model: LlamaForCausalLM, num_blocks: int = 96) -> ModelRunner:
    return ModelRunner(model, ModelShape.of(TINY_LLAMA), num_blocks, BLOCK_SIZE, torch.float32)


def shapes(samples: tuple[StepSample, ...]) -> list[tuple[int, int, int]]:
    return [(s.num_tokens, s.num_draft_tokens, s.num_draft_rows) for s in samples]


def test_the_profile_times_decodes_with_and_without_drafts_and_leaves_nothing(
    model: LlamaForCausalLM,
) -> None:
    runner = runner_of(model)
    samples = profile_steps(runner, max_num_seqs=4)
    assert DRAFT_LENGTHS == (1, 3, 7)  # token counts 1-8 a row: the step-time model's knots
    expected = [(r * (1 + k), r * k, r * (k > 0)) for k in (0, *DRAFT_LENGTHS) for r in (1, 4)]
    assert shapes(samples) == expected
    assert all(0 < s.seconds < 5 for s in samples)
    assert not runner.seqs and not runner.failed_seq_ids
    runner.check_integrity()
    # The pages it wrote are overwritten by real sequences: outputs are the reference's.
    limits = Limits(96, BLOCK_SIZE, 4, TINY_LLAMA.max_position_embeddings, 256, 64, 0.0)
    engine = LocalEngine(runner, limits, TINY_LLAMA.eos_token_id, check=True, step_profile=samples)
    assert engine.core.speculator.policy.step_time.num_profiled == len(samples)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = {"a": [5, 9, 3, 7, 1], "b": [40, 41, 42]}
    outputs = engine.run((0, seq_id, prompt, params) for seq_id, prompt in prompts.items())
    assert outputs == {s: reference_greedy(model, p, params.max_tokens) for s, p in prompts.items()}


def test_a_model_of_few_positions_gets_a_shorter_context(model: LlamaForCausalLM) -> None:
    runner = runner_of(model, num_blocks=15)  # 60 positions: 11 of context, one sequence
    samples = profile_steps(runner, max_num_seqs=8)
    assert len(samples) == 1 + len(DRAFT_LENGTHS) and not runner.seqs
    limits = Limits(15, BLOCK_SIZE, 2, TINY_LLAMA.max_position_embeddings, 256, 64, 0.0)
    engine = LocalEngine(runner, limits, TINY_LLAMA.eos_token_id, check=True)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    assert engine.run([(0, "a", [7] * 20, params)]) == {"a": reference_greedy(model, [7] * 20, 20)}


def test_a_model_that_fails_its_steps_sends_no_profile(model: LlamaForCausalLM) -> None:
    broken = LlamaForCausalLM(TINY_LLAMA, dtype=torch.float32).eval()
    with torch.no_grad():
        broken.norm.weight.fill_(float("nan"))  # every row's logits are NaN: the rows fail
    runner = runner_of(broken)
    assert profile_steps(runner, max_num_seqs=4) == ()
    assert not runner.seqs and not runner.failed_seq_ids


def test_one_row_workers_and_small_pools(model: LlamaForCausalLM) -> None:
    assert shapes(profile_steps(runner_of(model), max_num_seqs=1)) == [
        (1 + k, k, int(k > 0)) for k in (0, *DRAFT_LENGTHS)
    ]
    # A pool of 20 pages holds one synthetic sequence: the batched shapes are left out.
    assert len(profile_steps(runner_of(model, num_blocks=20), max_num_seqs=8)) == 1 + len(DRAFT_LENGTHS)
    runner = runner_of(model, num_blocks=4)  # 16 positions: too few for the decodes
    assert profile_steps(runner, max_num_seqs=8) == ()
    assert not runner.seqs
