"""The tiny DeepSeek-V3 model through the worker (its forward executor, step driver and the
scheduler core) against transformers on the same checkpoint, fp32: chunked prefill with mixed
decode rows, and the paged absorbed decode over a shuffled latent cache; and the KV spec the
worker reports."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers

from deepinfer.local_engine import LocalEngine
from libs.kvstore.kv_spec import MLA, KVSpec
from libs.modelfiles.deepseek_config import DeepseekV3Config
from libs.modelfiles.gguf_metadata import read_gguf_config
from libs.modelfiles.registry import resolve_model_path
from libs.models.deepseek_loader import load_deepseek_v3
from libs.models.deepseek_v3 import DeepseekV3ForCausalLM
from libs.models.tiny_deepseek import write_tiny_checkpoint
from libs.protocol.messages import SamplingParams
from services.scheduler.worker_scheduler import Limits
from services.worker.forward_executor import ForwardBatch, ForwardExecutor, ModelShape
from services.worker.model_runner import ModelRunner
from tests.deepseek_reference import hf_from_dir, hf_logits

BLOCK_SIZE = 4
ATOL = 1e-4
# The same reference checks on a GPU where there is one (bench/gpu_check.sh runs them there).
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-deepseek")
    write_tiny_checkpoint(directory, seed=5)
    return directory


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> DeepseekV3ForCausalLM:
    return load_deepseek_v3(checkpoint)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> transformers.PreTrainedModel:
    return hf_from_dir(checkpoint)


class _Seq:
    """A sequence driven by hand: its tokens, what is computed, its (shuffled) pages."""

    def __init__(self, tokens: list[int], pool: list[int]) -> None:
        self.tokens, self.num_computed = list(tokens), 0
        self.table = [pool.pop() for _ in range(16)]


def _step(executor: ForwardExecutor, rows: list[tuple[_Seq, int]]) -> list[torch.Tensor]:
    """One forward over ``rows`` (seq, tokens to compute), every position's logits, per row."""
    rows = sorted(rows, key=lambda r: r[1] == 1)
    ids: list[int] = []
    positions: list[int] = []
    for seq, n in rows:
        ids += seq.tokens[seq.num_computed : seq.num_computed + n]
        positions += range(seq.num_computed, seq.num_computed + n)
    batch = ForwardBatch(
        ids,
        positions,
        query_lens=[n for _, n in rows],
        context_lens=[seq.num_computed for seq, _ in rows],
        block_tables=[seq.table for seq, _ in rows],
        logits_index=list(range(len(ids))),
    )
    logits = executor.forward(batch)
    assert logits is not None
    logits = logits.cpu()
    out, start = [], 0
    for seq, n in rows:
        out.append(logits[start : start + n])
        start += n
        seq.num_computed += n
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_prefill_and_absorbed_decode_match_transformers(
    checkpoint: Path, reference: transformers.PreTrainedModel, device: str
) -> None:
    model = load_deepseek_v3(checkpoint, device=device)
    shape = ModelShape.of(model.config)
    executor = ForwardExecutor(model, shape, 64, BLOCK_SIZE, torch.float32, device)
    pool = list(range(64))
    random.Random(0).shuffle(pool)
    rng = random.Random(1)
    a = _Seq([rng.randrange(320) for _ in range(23)], pool)
    b = _Seq([rng.randrange(320) for _ in range(9)], pool)
    b_prefill = _step(executor, [(b, 9)])[0]
    torch.testing.assert_close(b_prefill, hf_logits(reference, b.tokens), atol=ATOL, rtol=0)
    # a's prompt in three chunks, each beside one of b's decodes (greedy, transformers' choice)
    for chunk in (7, 5, 11):
        b.tokens.append(int(hf_logits(reference, b.tokens)[-1].argmax()))
        start = a.num_computed
        a_logits, b_logits = _step(executor, [(b, 1), (a, chunk)])
        expected = hf_logits(reference, a.tokens[: start + chunk])[start:]
        torch.testing.assert_close(a_logits, expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(b_logits[0], hf_logits(reference, b.tokens)[-1], atol=ATOL, rtol=0)
    # then both decode together: the absorbed form over the paged latent cache
    for _ in range(8):
        for seq in (a, b):
            seq.tokens.append(int(hf_logits(reference, seq.tokens)[-1].argmax()))
        a_logits, b_logits = _step(executor, [(a, 1), (b, 1)])
        torch.testing.assert_close(a_logits[0], hf_logits(reference, a.tokens)[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(b_logits[0], hf_logits(reference, b.tokens)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_through_the_engine_equals_transformers(
    checkpoint: Path, reference: transformers.PreTrainedModel, device: str
) -> None:
    """Staggered arrivals, a token budget of 5 (chunked prefill), overlap scheduling."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = {"a": [5, 9, 3, 7, 1, 2, 8, 40, 41], "b": [300, 4, 6], "c": list(range(100, 119))}
    model = load_deepseek_v3(checkpoint, device=device)
    runner = ModelRunner(model, ModelShape.of(model.config), 48, BLOCK_SIZE, torch.float32, device)
    limits = Limits(48, BLOCK_SIZE, 8, model.config.max_position_embeddings, 5, 64, 0.0)
    engine = LocalEngine(runner, limits, model.config.eos_token_id or 1, overlap=True, check=True)
    outputs = engine.run(
        (step, seq_id, prompt, params) for step, (seq_id, prompt) in enumerate(prompts.items())
    )
    for seq_id, prompt in prompts.items():
        tokens = list(prompt)
        for _ in range(params.max_tokens):
            tokens.append(int(hf_logits(reference, tokens)[-1].argmax()))
        assert outputs[seq_id] == tokens[len(prompt) :], seq_id


def test_kv_spec_and_bytes_per_token() -> None:
    """V3's latent: 61 layers x (512 + 64) in bf16 = 70,272 B/token; SmolLM2 (30 layers, 3 KV heads
    of 64, K and V) = 23,040 B/token in bf16. The worker's pages follow the spec."""
    v3 = KVSpec.mla(num_layers=61, kv_lora_rank=512, rope_dim=64)
    assert (v3.kind, v3.num_planes, v3.head_dim) == (MLA, 1, 576)
    assert v3.bytes_per_token(2) == 70_272
    smollm2 = read_gguf_config(resolve_model_path("smollm2")).kv_spec()
    assert smollm2.bytes_per_token(2) == 23_040
    assert smollm2.block_shape(16) == (30, 2, 16, 3, 64)


def test_the_worker_pages_follow_the_mla_spec(model: DeepseekV3ForCausalLM) -> None:
    config: DeepseekV3Config = model.config
    runner = ModelRunner(model, ModelShape.of(config), 8, BLOCK_SIZE, torch.bfloat16)
    spec = runner.kv_cache.kv_spec
    assert spec == KVSpec.mla(config.num_hidden_layers, config.kv_lora_rank, config.qk_rope_head_dim)
    assert len(runner.kv_cache.planes) == 1 and len(runner.kv_cache.planes[0]) == config.num_hidden_layers
    assert runner.kv_cache.planes[0][0].shape == (8, BLOCK_SIZE, 1, 24)
    assert runner.kv_cache.bytes_per_token == config.num_hidden_layers * 24 * 2
    blocks = runner.kv_cache.gather_blocks([3, 1])
    assert blocks.shape == (2, config.num_hidden_layers, 1, BLOCK_SIZE, 1, 24)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_and_sampled_decoding_on_cuda(checkpoint: Path, reference: transformers.PreTrainedModel) -> None:
    """What `auto` picks on a GPU (bf16), and sampling at temperature 1 (seeded): argmax agreement
    with transformers' fp32 and a run through the engine that ends with its tokens."""
    model = load_deepseek_v3(checkpoint, torch.bfloat16, "cuda")
    executor = ForwardExecutor(model, ModelShape.of(model.config), 64, BLOCK_SIZE, torch.bfloat16, "cuda")
    pool = list(range(64))
    seq = _Seq([random.Random(3).randrange(320) for _ in range(40)], pool)
    logits = _step(executor, [(seq, 40)])[0]
    agree = (logits.argmax(-1) == hf_logits(reference, seq.tokens).argmax(-1)).float().mean()
    assert agree >= 0.9, agree
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=11)
    runner = ModelRunner(model, ModelShape.of(model.config), 48, BLOCK_SIZE, torch.bfloat16, "cuda")
    limits = Limits(48, BLOCK_SIZE, 8, model.config.max_position_embeddings, 64, 64, 0.0)
    engine = LocalEngine(runner, limits, model.config.eos_token_id or 1, overlap=False, check=True)
    outputs = engine.run([(0, "s", [5, 6, 7, 8], params), (0, "t", [9, 10], params)])
    assert all(len(tokens) == 8 and max(tokens) < 320 for tokens in outputs.values())
