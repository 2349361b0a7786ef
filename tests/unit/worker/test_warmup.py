"""The worker's warm-up: every sampling path and both prompt sizes run through the real
ModelRunner, and nothing is left behind (no sequence held, the runner's tables consistent)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from libs.models.llama import LlamaForCausalLM
from libs.protocol.messages import ModelRunnerOutput, SchedulerOutput
from services.worker import warmup
from services.worker.model_runner import ModelRunner, ModelShape
from tests.tiny_models import TINY_LLAMA

CONFIG = dataclasses.replace(TINY_LLAMA, max_position_embeddings=512)  # room for both prompts


def make_runner(num_blocks: int) -> ModelRunner:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG).eval()
    return ModelRunner(model, ModelShape.of(CONFIG), num_blocks, 16, torch.float32)


def recorded(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[SchedulerOutput, ModelRunnerOutput]]:
    steps: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    execute = runner.execute

    def spy(plan: SchedulerOutput) -> ModelRunnerOutput:
        out = execute(plan)
        steps.append((plan, out))
        return out

    monkeypatch.setattr(runner, "execute", spy)
    return steps


def test_every_path_runs_and_the_runner_is_left_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = make_runner(num_blocks=64)
    steps = recorded(runner, monkeypatch)
    warmup.warm_up(runner)
    prefills = [plan.new_seqs[0] for plan, _ in steps if plan.new_seqs]
    lens = sorted({seq.num_scheduled_tokens for seq in prefills})
    assert lens == sorted(warmup.WARM_PROMPT_LENS)
    assert {seq.sampling_params for seq in prefills} == {warmup.GREEDY, warmup.SAMPLED}
    assert len(steps) == len(prefills) * (1 + warmup.NUM_DECODES) == 4 * (1 + warmup.NUM_DECODES)
    # every step sampled its one token, and the sampled path returned logprobs
    assert all(len(out.seq_ids) == 1 and not out.error for _, out in steps)
    sampled = [out for plan, out in steps if plan.new_seqs and plan.new_seqs[0].sampling_params.logprobs]
    assert sampled and all(out.logprobs for out in sampled)
    assert runner.num_running_seqs == 0
    runner.check_integrity()


def test_a_pool_too_small_for_a_prompt_skips_it(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = make_runner(num_blocks=3)  # 48 slots: the 40-token prompt fits, the 160-token one does not
    steps = recorded(runner, monkeypatch)
    warmup.warm_up(runner)
    assert {plan.new_seqs[0].num_scheduled_tokens for plan, _ in steps if plan.new_seqs} == {40}
    assert runner.num_running_seqs == 0
    runner.check_integrity()
