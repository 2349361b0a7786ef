"""Tiny random-weight llama: shapes, GQA, fp32/bf16 agreement, and the AttentionFn cache contract."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from libs.kernels.attention import causal_attention
from libs.modelfiles.llama_config import LlamaConfig
from libs.models.attention import SingleSequenceCausalAttention
from libs.models.llama import LlamaForCausalLM
from tests.tiny_models import TINY_LLAMA

TINY = TINY_LLAMA


def tiny_model(
    config: LlamaConfig = TINY, dtype: torch.dtype = torch.float32, seed: int = 0
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(config, dtype=dtype).eval()


class CachedAttention:
    """A minimal cache-backed AttentionFn for one sequence: keeps every layer's k/v across calls."""

    def __init__(self) -> None:
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if layer_idx in self.k:
            k = torch.cat([self.k[layer_idx], k])
            v = torch.cat([self.v[layer_idx], v])
        self.k[layer_idx], self.v[layer_idx] = k, v
        return causal_attention(q, k, v)  # new queries sit at the end of the cached keys


class VarlenAttention:
    """Several sequences packed flat; each attends causally within its own segment only."""

    def __init__(self, seq_lens: list[int]) -> None:
        self.seq_lens = seq_lens

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        parts = zip(q.split(self.seq_lens), k.split(self.seq_lens), v.split(self.seq_lens), strict=True)
        return torch.cat([causal_attention(qs, ks, vs) for qs, ks, vs in parts])


class RecordingAttention(SingleSequenceCausalAttention):
    def __init__(self) -> None:
        self.calls: list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.calls.append((layer_idx, tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return super().__call__(layer_idx, q, k, v)


def run(model: LlamaForCausalLM, ids: Tensor, attention: object | None = None) -> Tensor:
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), attention or SingleSequenceCausalAttention())
        return model.compute_logits(hidden)


def test_forward_shapes_and_logits_dtype() -> None:
    model = tiny_model()
    ids = torch.randint(0, TINY.vocab_size, (9,))
    with torch.inference_mode():
        hidden = model(ids, torch.arange(9), SingleSequenceCausalAttention())
        logits = model.compute_logits(hidden)
    assert hidden.shape == (9, TINY.hidden_size)
    assert logits.shape == (9, TINY.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_gqa_shapes_reach_attention_per_layer() -> None:
    attention = RecordingAttention()
    run(tiny_model(), torch.arange(5), attention)
    assert attention.calls == [
        (layer, (5, 4, 16), (5, 2, 16), (5, 2, 16)) for layer in range(TINY.num_hidden_layers)
    ]


def test_tied_and_untied_heads() -> None:
    tied = tiny_model()
    assert tied.lm_head is None and "lm_head.weight" not in tied.state_dict()
    untied = tiny_model(dataclasses.replace(TINY, tie_word_embeddings=False))
    assert untied.lm_head is not None and "lm_head.weight" in untied.state_dict()
    assert "cos_sin_cache" not in untied.state_dict()  # derived, never stored


def test_bf16_agrees_with_fp32() -> None:
    model32 = tiny_model()
    model16 = LlamaForCausalLM(TINY, dtype=torch.bfloat16).eval()
    model16.load_state_dict({k: v.bfloat16() for k, v in model32.state_dict().items()})
    assert model16.dtype == torch.bfloat16
    ids = torch.randint(0, TINY.vocab_size, (48,), generator=torch.Generator().manual_seed(1))
    logits32, logits16 = run(model32, ids), run(model16, ids)
    assert logits16.dtype == torch.float32
    agreement = (logits32.argmax(-1) == logits16.argmax(-1)).float().mean().item()
    assert agreement >= 0.9, agreement
    scale = logits32.abs().max().item()
    assert (logits32 - logits16).abs().max().item() < 0.05 * scale


def test_token_by_token_decode_with_cache_equals_full_forward() -> None:
    model = tiny_model()
    ids = torch.randint(0, TINY.vocab_size, (20,), generator=torch.Generator().manual_seed(2))
    full = run(model, ids)

    attention = CachedAttention()
    steps = [(0, 5), *[(i, i + 1) for i in range(5, 20)]]  # prefill 5, then decode one at a time
    with torch.inference_mode():
        for start, end in steps:
            hidden = model(ids[start:end], torch.arange(start, end), attention)
            torch.testing.assert_close(model.compute_logits(hidden), full[start:end], atol=1e-5, rtol=1e-5)
    assert attention.k[0].shape == (20, TINY.num_key_value_heads, TINY.head_dim)


def test_chunked_prefill_equals_full_forward() -> None:
    model = tiny_model()
    ids = torch.randint(0, TINY.vocab_size, (17,), generator=torch.Generator().manual_seed(3))
    attention = CachedAttention()
    with torch.inference_mode():
        chunks = [model(ids[s : s + 6], torch.arange(s, min(s + 6, 17)), attention) for s in range(0, 17, 6)]
        logits = model.compute_logits(torch.cat(chunks))
    torch.testing.assert_close(logits, run(model, ids), atol=1e-5, rtol=1e-5)


def test_packed_sequences_equal_separate_forwards() -> None:
    model = tiny_model()
    a, b = torch.randint(0, 128, (7,)), torch.randint(0, 128, (4,))
    ids = torch.cat([a, b])
    positions = torch.cat([torch.arange(7), torch.arange(4)])  # each sequence restarts at 0
    with torch.inference_mode():
        packed = model.compute_logits(model(ids, positions, VarlenAttention([7, 4])))
    torch.testing.assert_close(packed, torch.cat([run(model, a), run(model, b)]), atol=1e-5, rtol=1e-5)


def test_only_relative_positions_matter() -> None:
    model = tiny_model()
    ids = torch.tensor([3, 4, 5])
    with torch.inference_mode():
        at_zero = model(ids, torch.arange(3), SingleSequenceCausalAttention())
        shifted = model(ids, torch.arange(10, 13), SingleSequenceCausalAttention())
        spread = model(ids, torch.tensor([0, 5, 6]), SingleSequenceCausalAttention())
    # Rope makes attention depend on position differences only: a common shift changes nothing,
    # a different spacing changes every token that attends to an earlier one.
    torch.testing.assert_close(at_zero, shifted, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(at_zero[1:], spread[1:], atol=1e-3)


@pytest.mark.parametrize(
    ("field", "value"), [("num_key_value_heads", 3), ("head_dim", 15), ("num_hidden_layers", 0)]
)
def test_config_rejects_bad_shapes(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(TINY, **{field: value})
