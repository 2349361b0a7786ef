"""Predicted Outputs on the real SmolLM2 in fp32, through the scheduler core and the real
ModelRunner: a prediction changes no token (greedy and seeded, overlap on and off), a right one
is accepted almost whole, an edited one re-aligns after the edit, a wrong one is rejected, and
the counts the request's usage reports add up to what was drafted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.local_engine import LocalEngine
from libs.models.gguf_loader import load_llama
from libs.models.llama import LlamaForCausalLM
from libs.protocol.messages import SamplingParams
from libs.recipe.chat_template import render_chat
from libs.recipe.tokenizer import Tokenizer
from services.scheduler.worker_scheduler import Limits
from services.worker.model_runner import ModelRunner, ModelShape

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=32, ignore_eos=True)
ASK = "Write a Python function that returns the sum of a list of numbers."


@pytest.fixture(scope="module")
def model(smollm2_path: Path, model_cache_dir: Path) -> LlamaForCausalLM:
    return load_llama(smollm2_path, model_cache_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path, model_cache_dir: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path, model_cache_dir)


def generate(
    model: LlamaForCausalLM,
    prompt: list[int],
    params: SamplingParams,
    prediction: list[int] | None,
    overlap: bool = True,
    k: int = 5,
) -> tuple[list[int], tuple[int, int]]:
    """The request's tokens, and (accepted, rejected) prediction tokens."""
    cfg = model.config
    # fixed: the counts below are of drafts verified whole (the adaptive policy is tested elsewhere)
    limits = Limits(
        64,
        16,
        4,
        cfg.max_position_embeddings,
        2048,
        64,
        0.0,
        num_speculative_tokens=k,
        speculative_policy="fixed",
    )
    runner = ModelRunner(model, ModelShape.of(cfg), 64, 16, torch.float32)
    assert cfg.eos_token_id is not None
    engine = LocalEngine(runner, limits, cfg.eos_token_id, overlap=overlap, check=True)
    engine.add("r", prompt, params, prediction_token_ids=prediction)
    outputs = engine.run()
    seq = engine.finished["r"]
    counts = (seq.num_unsent_accepted_prediction_tokens, seq.num_unsent_rejected_prediction_tokens)
    stats = engine.core.speculator.stats
    assert stats["ngram"].num_verified == 0  # no automatic method: every draft is the prediction's
    assert (stats["prediction"].num_accepted, stats["prediction"].num_drafted) == (counts[0], sum(counts))
    return outputs["r"], counts


@pytest.fixture(scope="module")
def prompt(tokenizer: Tokenizer) -> list[int]:
    assert tokenizer.chat_template is not None
    return tokenizer.encode(render_chat(tokenizer.chat_template, [{"role": "user", "content": ASK}]))


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_right_prediction_is_accepted_and_changes_no_token(
    model: LlamaForCausalLM, prompt: list[int], params: SamplingParams, overlap: bool
) -> None:
    expected, none = generate(model, prompt, params, None, overlap)
    assert none == (0, 0)
    tokens, (accepted, rejected) = generate(model, prompt, params, expected, overlap)
    assert tokens == expected
    # Each verification of up to 5 drafts also samples one token itself, and the first token
    # comes from the prefill: the rest is drafted, all of it right.
    assert rejected == 0 and accepted >= (len(expected) - 1) * 5 // 6


def test_an_edited_prediction_realigns_after_the_edit(
    model: LlamaForCausalLM, prompt: list[int], tokenizer: Tokenizer
) -> None:
    expected, _ = generate(model, prompt, GREEDY, None)
    removed = expected[:10] + expected[14:]  # 4 tokens the output has are not predicted
    inserted = expected[:10] + tokenizer.encode_plain(" lorem ipsum dolor") + expected[10:]
    for prediction in (removed, inserted):
        tokens, (accepted, rejected) = generate(model, prompt, GREEDY, prediction)
        assert tokens == expected
        assert 0 < rejected <= 10  # the drafts at the edit, not what follows it
        assert accepted >= len(expected) // 2  # before the edit, and again after it


def test_a_wrong_prediction_is_rejected_and_changes_no_token(
    model: LlamaForCausalLM, prompt: list[int], tokenizer: Tokenizer
) -> None:
    expected, _ = generate(model, prompt, GREEDY, None)
    # It starts as the output does (else nothing in it follows the first token: no draft at all)
    wrong = expected[:1] + tokenizer.encode_plain(" harbour town woke early, and the ferry ran every hour.")
    tokens, (accepted, rejected) = generate(model, prompt, GREEDY, wrong, k=3)
    assert tokens == expected
    assert rejected >= 3 and accepted <= 1
