"""The paged, batched engine on the real SmolLM2 in fp32 against a plain unpaged forward.

Mixed batches with arrivals mid-flight, chunked vs unchunked prefill, overlap on and off, and a KV
pool small enough to force preemption all give the same greedy tokens as re-running each whole
sequence alone for every token (no cache, no batching, no paging).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from deepinfer.local_engine import LocalEngine
from libs.models.gguf_loader import load_llama
from libs.models.llama import LlamaForCausalLM
from libs.protocol.messages import SamplingParams, StructuredOutput, StructuredOutputKind
from libs.recipe.tokenizer import Tokenizer
from services.scheduler.worker_scheduler import Limits
from services.worker.grammar_compilers import Grammars
from services.worker.main import grammar_vocab
from services.worker.model_runner import ModelRunner, ModelShape
from services.worker.step_profile import profile_steps
from tests.reference import chat_prompts, reference_greedy

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Write one sentence about the sea, the wind and the long journey of a small boat home.",
    "2+2=?",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model(smollm2_path: Path, model_cache_dir: Path) -> LlamaForCausalLM:
    return load_llama(smollm2_path, model_cache_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(smollm2_path: Path, model_cache_dir: Path) -> dict[str, list[int]]:
    return chat_prompts(Tokenizer.from_gguf(smollm2_path, model_cache_dir), QUESTIONS)


@pytest.fixture(scope="module")
def reference(model: LlamaForCausalLM, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    return {seq_id: reference_greedy(model, p, GREEDY.max_tokens) for seq_id, p in prompts.items()}


def make_engine(
    model: LlamaForCausalLM, num_blocks: int, budget: int, overlap: bool, block_size: int = 16
) -> LocalEngine:
    cfg = model.config
    runner = ModelRunner(model, ModelShape.of(cfg), num_blocks, block_size, torch.float32)
    # The preemption case (few blocks) needs the prompts' full demand: their shared prefix would
    # otherwise fit in the cache and nothing would be preempted.
    caching = num_blocks >= 32
    limits = Limits(num_blocks, block_size, 8, cfg.max_position_embeddings, budget, 64, 0.0, caching)
    return LocalEngine(runner, limits, cfg.eos_token_id, overlap=overlap, check=True)


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "budget", "overlap"),
    [
        (256, 16, 2048, False),  # whole prompts, no overlap
        (256, 16, 2048, True),  # the same with overlap
        (256, 16, 24, True),  # chunked prefill: 24-token steps
        (20, 4, 2048, False),  # 80 KV slots for two ~40-token prompts that grow: preemption
    ],
)
def test_engine_matches_the_unpaged_reference(
    model: LlamaForCausalLM,
    prompts: dict[str, list[int]],
    reference: dict[str, list[int]],
    num_blocks: int,
    block_size: int,
    budget: int,
    overlap: bool,
) -> None:
    engine = make_engine(model, num_blocks, budget, overlap, block_size)
    arrivals = [(2 * i, seq_id, p, GREEDY) for i, (seq_id, p) in enumerate(prompts.items())]
    outputs = engine.run(arrivals)
    assert outputs == reference
    if num_blocks < 32:
        assert engine.num_preemptions > 0


def test_choices_share_the_prompt_in_fp32(
    model: LlamaForCausalLM, prompts: dict[str, list[int]], reference: dict[str, list[int]]
) -> None:
    engine = make_engine(model, 64, 2048, overlap=True)
    outputs = engine.run([(0, "q0", prompts["q0"], dataclasses.replace(GREEDY, n=2))])
    assert outputs == {"q0": reference["q0"], "q0#1": reference["q0"]}


CODE = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add("


@pytest.mark.parametrize(
    ("overlap", "num_blocks", "policy"), [(False, 256, "fixed"), (True, 24, "fixed"), (True, 256, "adaptive")]
)
def test_speculative_decoding_keeps_the_tokens(
    model: LlamaForCausalLM,
    smollm2_path: Path,
    model_cache_dir: Path,
    prompts: dict[str, list[int]],
    overlap: bool,
    num_blocks: int,
    policy: str,
) -> None:
    """n-gram drafts on SmolLM2 change no token: code that repeats itself accepts many drafts,
    chat answers reject most; with a stop token inside an accepted draft (nothing after it is
    kept), a grammar-constrained neighbour (24 tokens: its way out is near, so it verifies none),
    under preemption (24 blocks), and with the adaptive policy on the machine's own step times
    (profiled at start, then measured)."""
    tokenizer = Tokenizer.from_gguf(smollm2_path, model_cache_dir)
    vocab = grammar_vocab(smollm2_path, model_cache_dir, model.config.vocab_size)
    params = dataclasses.replace(GREEDY, max_tokens=24)
    plus = tokenizer.encode_plain(" +")  # the copied code writes it a few tokens in, inside a draft
    assert len(plus) == 1
    constrained = StructuredOutput(StructuredOutputKind.JSON)
    arrivals = [
        (0, "code", tokenizer.encode(CODE), params),
        (1, "q1", prompts["q1"], params),
        (2, "stop", tokenizer.encode(CODE), dataclasses.replace(params, stop_token_ids=(plus[0],))),
        (
            2,
            "json",
            prompts["q0"],
            dataclasses.replace(params, ignore_eos=False, structured_output=constrained),
        ),
    ]
    outputs = []
    for k in (0, 5):
        cfg = model.config
        block_size = 4 if num_blocks < 32 else 16
        limits = Limits(
            num_blocks,
            block_size,
            8,
            cfg.max_position_embeddings,
            2048,
            64,
            0.0,
            speculative_method="ngram" if k else "none",
            num_speculative_tokens=k,
            speculative_policy=policy,
        )
        runner = ModelRunner(
            model, ModelShape.of(cfg), num_blocks, block_size, torch.float32, grammars=Grammars(vocab)
        )
        # As a worker does before it announces itself, the adaptive policy's step times start
        # from a profile of this machine (services/worker/step_profile.py).
        profile = profile_steps(runner, limits.max_num_seqs) if policy == "adaptive" and k else ()
        engine = LocalEngine(
            runner, limits, cfg.eos_token_id, overlap=overlap, check=True, step_profile=profile
        )
        outputs.append(engine.run(arrivals))
        if num_blocks < 32:
            assert engine.num_preemptions > 0
    assert outputs[1] == outputs[0]
    assert len(outputs[0]["stop"]) < params.max_tokens and outputs[0]["stop"][-1] == plus[0]
    assert outputs[0]["stop"] == outputs[0]["code"][: len(outputs[0]["stop"])]
    answer = outputs[0]["json"]
    assert isinstance(
        json.loads(tokenizer.decode(answer[:-1] if answer[-1] == model.config.eos_token_id else answer)), dict
    )
    stats = engine.core.speculator.stats["ngram"]
    assert 0 < stats.num_accepted < stats.num_drafted
    if policy == "adaptive":  # it measured steps, and they are what it decided on
        assert engine.core.speculator.policy.step_time.num_observed > 0
    # The repeated code is drafted right. (With few blocks, drafts never take one a decode may
    # need: fewer of them. The adaptive policy verifies what pays on this machine's step times,
    # which in a run this short may be little: bench/spec_decode.py weighs what it gains.)
    if num_blocks >= 32 and policy == "fixed":
        assert stats.num_accepted >= params.max_tokens // 3


def test_suffix_drafts_come_from_earlier_outputs(
    model: LlamaForCausalLM, prompts: dict[str, list[int]], reference: dict[str, list[int]]
) -> None:
    """With the suffix source, requests that write what earlier ones wrote draft it from their
    outputs, and no token changes."""
    cfg = model.config
    limits = Limits(
        256, 16, 8, cfg.max_position_embeddings, 2048, 64, 0.0,
        speculative_method="suffix", num_speculative_tokens=5, speculative_policy="fixed",
    )  # fmt: skip
    runner = ModelRunner(model, ModelShape.of(cfg), 256, 16, torch.float32)
    engine = LocalEngine(runner, limits, cfg.eos_token_id, overlap=True, check=True)
    first = dict(engine.run([(i, name, p, GREEDY) for i, (name, p) in enumerate(prompts.items())]))
    suffix = engine.core.speculator.stats["suffix"]
    drafted_before = suffix.num_drafted
    outputs = engine.run([(0, f"{name}-again", prompt, GREEDY) for name, prompt in prompts.items()])
    assert first == reference
    assert {name: outputs[f"{name}-again"] for name in prompts} == reference
    assert suffix.num_drafted > drafted_before and suffix.num_accepted > 0
    total = engine.core.speculator.stats
    assert sum(s.num_accepted for s in total.values()) < sum(s.num_drafted for s in total.values())
