"""--deterministic with the real SmolLM2 in bf16, in process (the real ModelRunner and scheduler
core): 8 chat prompts give the same greedy tokens each alone as arriving at random steps into a
batch with 24-token prefill chunks and a KV pool that forces preemption. Arrivals at random steps
make the batches mix rows of every length and phase (the stack's case); a version whose products
took strided operands for some of them failed here."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from deepinfer.local_engine import LocalEngine
from libs.models.gguf_loader import load_llama
from libs.models.llama import LlamaForCausalLM
from libs.protocol.messages import SamplingParams
from libs.recipe.tokenizer import Tokenizer
from services.scheduler.worker_scheduler import Limits
from services.worker.model_runner import ModelRunner, ModelShape
from tests.reference import chat_prompts
from tests.system.test_deterministic import QUESTIONS

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def model(smollm2_path: Path, model_cache_dir: Path) -> LlamaForCausalLM:
    return load_llama(smollm2_path, model_cache_dir, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def prompts(smollm2_path: Path, model_cache_dir: Path) -> dict[str, list[int]]:
    return chat_prompts(Tokenizer.from_gguf(smollm2_path, model_cache_dir), QUESTIONS)


def _engine(model: LlamaForCausalLM, num_blocks: int, budget: int) -> LocalEngine:
    config = model.config
    runner = ModelRunner(model, ModelShape.of(config), num_blocks, 16, torch.bfloat16, batch_invariant=True)
    limits = Limits(num_blocks, 16, 8, config.max_position_embeddings, budget, 64, 0.0)
    assert config.eos_token_id is not None
    return LocalEngine(runner, limits, config.eos_token_id, overlap=True)


def test_random_arrivals_give_the_tokens_of_each_alone(
    model: LlamaForCausalLM, prompts: dict[str, list[int]]
) -> None:
    alone: dict[str, list[int]] = {}
    for seq_id, prompt in prompts.items():
        alone |= _engine(model, 256, 512).run([(0, seq_id, prompt, GREEDY)])
    for seed in (1, 3):
        rng = random.Random(seed)
        engine = _engine(model, 17, 24)
        arrivals = [(rng.randint(0, 12), seq_id, prompt, GREEDY) for seq_id, prompt in prompts.items()]
        assert engine.run(arrivals) == alone, seed
        assert engine.core.num_preemptions > 0
