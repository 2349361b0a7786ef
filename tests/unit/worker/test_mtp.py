"""MTP drafts through the real ModelRunner and scheduler core (tiny DeepSeek, fp32).

The drafter's every draft is the plain-torch reference's (the main model and the MTP module over
the whole sequence, no pages, no batching), through chunked prefill, batched decodes and
verification rows that reject; and with MTP drafts greedy and seeded tokens are those without
speculation, with overlap on and off, under preemption and with n > 1. Every case checks that
drafts were both accepted and rejected in it. The model is ``lookahead_deepseek``: its MTP
module copies its layer, so drafts are often right, and noise makes some wrong.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from deepinfer.local_engine import LocalEngine
from libs.models.attention import SingleSequenceMLAAttention
from libs.models.deepseek_v3 import DeepseekV3ForCausalLM
from libs.models.tiny_deepseek import lookahead_deepseek, write_tiny_checkpoint
from libs.protocol.messages import ModelRunnerOutput, SamplingParams, SchedulerOutput
from services.scheduler.limits import Limits
from services.worker.config import Config as WorkerConfig
from services.worker.model_loading import load_model
from services.worker.model_runner import ModelRunner, ModelShape
from services.worker.mtp_drafter import MTPDrafter
from services.worker.step_profile import DRAFT_LENGTHS, profile_steps

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, ignore_eos=True, seed=7)
PROMPTS = {
    "a": [5, 9, 3, 7, 1, 2, 8, 11, 5, 9, 3],
    "b": [40, 41, 42, 43, 40, 41],
    "c": [60, 61, 62, 63, 64, 65, 66, 67, 68],
    "long": [(7 * i) % 300 + 2 for i in range(45)],  # prefilled in chunks (max 32 tokens a step)
}


@pytest.fixture(scope="module")
def model() -> DeepseekV3ForCausalLM:
    return lookahead_deepseek(seed=3, mtp_noise=0.03)


class RecordingRunner:
    """The runner, and each draft it returned with the tokens it follows."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.drafts: list[tuple[list[int], int, float]] = []

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        out = self.runner.execute(plan)
        for seq_id, (token_id, probability) in zip(out.seq_ids, out.drafts() or [], strict=False):
            self.drafts.append((list(self.runner.seqs[seq_id].token_ids), token_id, probability))
        return out

    def check_integrity(self) -> None:
        self.runner.check_integrity()


def make_engine(
    model: DeepseekV3ForCausalLM, method: str, overlap: bool = False, num_blocks: int = 96
) -> tuple[LocalEngine, RecordingRunner]:
    limits = Limits(
        num_blocks,
        BLOCK_SIZE,
        8,
        model.config.max_position_embeddings,
        32,
        64,
        0.0,
        speculative_method=method,
        num_speculative_tokens=0 if method == "none" else 1,
        speculative_policy="fixed",
    )
    drafter = None
    if method == "mtp":
        drafter = MTPDrafter(model, num_blocks, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    shape = ModelShape.of(model.config)
    runner = RecordingRunner(
        ModelRunner(model, shape, num_blocks, BLOCK_SIZE, torch.float32, drafter=drafter)
    )
    eos_token_id = model.config.eos_token_id
    assert eos_token_id is not None
    return LocalEngine(runner, limits, eos_token_id, overlap, check=True), runner


def serve(
    engine: LocalEngine, params: SamplingParams, prompts: dict[str, list[int]] = PROMPTS
) -> dict[str, list[int]]:
    return engine.run((i, seq_id, prompt, params) for i, (seq_id, prompt) in enumerate(prompts.items()))


def assert_drafts_accepted_and_rejected(engine: LocalEngine) -> None:
    stats = engine.core.speculator.stats["mtp"]
    assert 0 < stats.num_accepted < stats.num_drafted, stats


@torch.inference_mode()
def reference_draft(model: DeepseekV3ForCausalLM, tokens: list[int]) -> tuple[int, float]:
    """The module's greedy token after ``tokens`` and its probability, from the whole sequence."""
    ids = torch.tensor(tokens)
    attention = SingleSequenceMLAAttention()
    hidden = model(ids, torch.arange(len(tokens)), attention)
    out = model.forward_mtp(0, ids[1:], hidden[:-1], torch.arange(len(tokens) - 1), attention)
    probs = torch.softmax(model.compute_logits(out[-1:])[0], dim=-1)
    return int(probs.argmax()), float(probs.max())


@torch.inference_mode()
def reference_greedy(model: DeepseekV3ForCausalLM, prompt: list[int], num_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), SingleSequenceMLAAttention())
        tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("overlap", [False, True])
def test_each_draft_is_the_reference_modules(model: DeepseekV3ForCausalLM, overlap: bool) -> None:
    engine, runner = make_engine(model, "mtp", overlap)
    serve(engine, GREEDY)
    assert_drafts_accepted_and_rejected(engine)  # verification rows rolled back rejected drafts
    assert len(runner.drafts) > 4 * len(PROMPTS)
    for tokens, token_id, probability in runner.drafts:
        expected_id, expected_p = reference_draft(model, tokens)
        assert token_id == expected_id, len(tokens)
        assert probability == pytest.approx(expected_p, abs=1e-4)


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_tokens_are_those_without_speculation(model: DeepseekV3ForCausalLM, overlap: bool) -> None:
    plain = serve(make_engine(model, "none", overlap)[0], GREEDY)
    assert plain == {s: reference_greedy(model, p, GREEDY.max_tokens) for s, p in PROMPTS.items()}
    engine, _ = make_engine(model, "mtp", overlap)
    assert serve(engine, GREEDY) == plain
    assert_drafts_accepted_and_rejected(engine)


def test_seeded_samples_preemption_and_n_choices_keep_the_tokens(model: DeepseekV3ForCausalLM) -> None:
    params = dataclasses.replace(SEEDED, n=2)
    plain = serve(make_engine(model, "none", True, num_blocks=24)[0], params)
    engine, _ = make_engine(model, "mtp", True, num_blocks=24)
    assert serve(engine, params) == plain
    assert engine.num_preemptions > 0
    assert_drafts_accepted_and_rejected(engine)


def test_the_scheduler_drops_a_draft_that_no_longer_follows(model: DeepseekV3ForCausalLM) -> None:
    """A proposal is for the tokens the sequence had when it came: later tokens make it stale."""
    engine, _ = make_engine(model, "mtp")
    engine.add("a", PROMPTS["a"], GREEDY)
    speculator = engine.core.speculator
    seq = engine.core.seqs["a"]
    speculator.proposed(seq, 17, 0.9)
    assert speculator._from_drafter(seq) == ([17], 4)  # a probability of 0.9 is the top bucket
    speculator.proposed(seq, 17, 0.1)
    seq.output_token_ids.append(3)
    assert speculator._from_drafter(seq) == ([], 0)


def test_the_worker_loads_the_mtp_module_only_to_draft(tmp_path: Path, smollm2_path: Path) -> None:
    write_tiny_checkpoint(tmp_path / "tiny", seed=1)
    drafting = load_model(tmp_path / "tiny", tmp_path, "float32", with_mtp=True)
    assert isinstance(drafting, DeepseekV3ForCausalLM) and len(drafting.mtp) == 1
    MTPDrafter(drafting, 8, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    plain = load_model(tmp_path / "tiny", tmp_path, "float32")
    assert isinstance(plain, DeepseekV3ForCausalLM) and len(plain.mtp) == 0
    with pytest.raises(ValueError, match="no MTP module"):
        MTPDrafter(plain, 8, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="DeepSeek-V3-family"):
        load_model(smollm2_path, tmp_path, "float32", with_mtp=True)
    with pytest.raises(ValueError, match="speculative_method"):
        WorkerConfig(speculative_method="eagle")


def test_the_start_up_profile_leaves_the_drafter_exact(model: DeepseekV3ForCausalLM) -> None:
    """The worker's step profile runs verification rows through the drafter too; afterwards every
    draft is still the reference module's and the tokens are those without speculation."""
    plain = serve(make_engine(model, "none")[0], GREEDY)
    engine, runner = make_engine(model, "mtp")
    assert len(profile_steps(runner.runner, max_num_seqs=8)) == 2 * (1 + len(DRAFT_LENGTHS))
    assert not runner.runner.seqs
    assert serve(engine, GREEDY) == plain
    assert_drafts_accepted_and_rejected(engine)
    for tokens, token_id, _ in runner.drafts:
        assert token_id == reference_draft(model, tokens)[0], len(tokens)
