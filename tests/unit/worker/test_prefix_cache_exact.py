"""Prefix caching against the real ModelRunner on the tiny random-weight model in fp32: requests
that start on cached KV blocks produce exactly the greedy tokens of the same requests served cold
(prefix caching off) and of the plain unpaged reference, with and without overlap, with chunked
prefill, under preemption and with n > 1, and report the cached prompt tokens.

The random model repeats its last input token with probability ~1, so equal greedy tokens (or their
logprobs, all ~0) would say little about the KV a hit reads; the logprobs of the runner-up tokens
move by units when the context changes. So every step's top-5 token ids and logprobs must match
the reference's, computed by one unpaged forward over the whole sequence."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.local_engine import LocalEngine
from libs.models.attention import SingleSequenceCausalAttention
from libs.models.llama import LlamaForCausalLM
from libs.protocol.codec import unpack_floats, unpack_tokens
from libs.protocol.messages import SamplingParams
from services.scheduler.worker_scheduler import Limits
from services.worker.model_runner import ModelRunner, ModelShape
from tests.reference import reference_greedy
from tests.tiny_models import TINY_LLAMA

CONFIG = TINY_LLAMA
BLOCK_SIZE = 4
NUM_TOP = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=NUM_TOP)
SHARED = [5, 9, 3, 7, 1, 2, 8, 11, 12, 13, 14, 15, 16, 17]  # 3 full blocks, then 2 tokens
WARM = {"w": [*SHARED, 20, 21, 22]}  # served first, alone: its blocks are what later requests hit
PROMPTS = {
    "a": [*SHARED, 20, 21, 22],  # w's twin: all cached but the last token's block
    "b": [*SHARED, 30],  # 3 cached blocks, then 3 tokens to compute
    "c": [*SHARED[:9], 40, 41, 42, 43, 44, 45],  # 2 cached blocks, then a miss
    "d": [50, 51, 52, 53, 54, 55, 56, 57, 58],  # nothing in common
    "e": [*SHARED[:8], 50, 51, 52, 53, 54, 55, 56, 57, 58],  # hits w's head and, later, d's nothing
}
ARRIVALS = {"a": 0, "b": 0, "c": 1, "d": 2, "e": 4}
CACHED = {"a": 16, "b": 12, "c": 8, "d": 0, "e": 8}  # prompt tokens a hit skips


@pytest.fixture(scope="module")
def reference(model: LlamaForCausalLM) -> dict[str, list[int]]:
    prompts = PROMPTS | WARM
    return {s: reference_greedy(model, p, GREEDY.max_tokens) for s, p in prompts.items()}


@torch.inference_mode()
def reference_top_logprobs(
    model: LlamaForCausalLM, prompt: list[int], output: list[int]
) -> tuple[list[int], list[float]]:
    """Top-``NUM_TOP`` ids and logprobs before each output token, from one unpaged forward."""
    tokens = prompt + output
    hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), SingleSequenceCausalAttention())
    logits = model.compute_logits(hidden[len(prompt) - 1 : -1]).float()
    top = torch.log_softmax(logits, -1).topk(NUM_TOP, dim=-1)
    return top.indices.flatten().tolist(), top.values.flatten().tolist()


def check_logprobs(model: LlamaForCausalLM, engine: LocalEngine, prompts: dict[str, list[int]]) -> None:
    for seq_id, seq in engine.finished.items():
        ids = [i for part in seq.unsent_logprobs for i in unpack_tokens(part.top_token_ids)]
        values = [x for part in seq.unsent_logprobs for x in unpack_floats(part.top_logprobs)]
        prompt = prompts[seq_id.split("#")[0]]
        want_ids, want_values = reference_top_logprobs(model, prompt, seq.output_token_ids)
        assert ids == want_ids, seq_id
        assert values == pytest.approx(want_values, abs=1e-3), seq_id


def make_engine(
    model: LlamaForCausalLM,
    prefix_caching: bool,
    num_blocks: int = 64,
    max_num_batched_tokens: int = 256,
    overlap: bool = False,
) -> LocalEngine:
    limits = Limits(
        num_blocks,
        BLOCK_SIZE,
        8,
        CONFIG.max_position_embeddings,
        max_num_batched_tokens,
        64,
        0.0,
        enable_prefix_caching=prefix_caching,
    )
    runner = ModelRunner(model, ModelShape.of(CONFIG), num_blocks, BLOCK_SIZE, torch.float32)
    return LocalEngine(runner, limits, CONFIG.eos_token_id, overlap, check=True)


def serve(engine: LocalEngine, params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    """The warm-up request alone, then the others staggered."""
    engine.run((0, s, p, params) for s, p in WARM.items())
    return engine.run((ARRIVALS[s], s, p, params) for s, p in PROMPTS.items())


@pytest.mark.parametrize(
    ("max_num_batched_tokens", "overlap"), [(256, False), (256, True), (5, False), (5, True)]
)
def test_hits_give_the_same_tokens_as_cold_and_the_reference(
    model: LlamaForCausalLM, reference: dict[str, list[int]], max_num_batched_tokens: int, overlap: bool
) -> None:
    engines = {
        cached: make_engine(model, cached, max_num_batched_tokens=max_num_batched_tokens, overlap=overlap)
        for cached in (False, True)
    }
    cold, warm = serve(engines[False]), serve(engines[True])
    assert cold == warm == reference
    for engine in engines.values():
        check_logprobs(model, engine, PROMPTS | WARM)
    assert engines[False].core.prefix_cache_stats.num_queries == 0
    assert all(seq.num_cached_tokens == 0 for seq in engines[False].finished.values())
    assert {s: engines[True].finished[s].num_cached_tokens for s in PROMPTS} == CACHED
    assert engines[True].core.prefix_cache_stats.num_hit_tokens >= sum(CACHED.values())


def test_preemption_with_prefix_caching_resumes_to_the_same_tokens(
    model: LlamaForCausalLM, reference: dict[str, list[int]]
) -> None:
    engine = make_engine(model, True, num_blocks=12, max_num_batched_tokens=5, overlap=True)
    assert serve(engine) == reference
    check_logprobs(model, engine, PROMPTS | WARM)
    assert engine.num_preemptions > 0
    assert engine.core.prefix_cache_stats.num_evicted_blocks > 0
    assert engine.core.block_manager.num_free_blocks == 12


def test_choices_on_a_cached_prefix_each_match_the_reference(
    model: LlamaForCausalLM, reference: dict[str, list[int]]
) -> None:
    engine = make_engine(model, True, overlap=True)
    engine.run((0, s, p, GREEDY) for s, p in WARM.items())
    outputs = engine.run([(0, "r", PROMPTS["b"], dataclasses.replace(GREEDY, n=3))])
    assert outputs == {"w": reference["w"], "r": reference["b"], "r#1": reference["b"], "r#2": reference["b"]}
    check_logprobs(model, engine, WARM | {"r": PROMPTS["b"]})
    assert engine.finished["r"].num_cached_tokens == 12
