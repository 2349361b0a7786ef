"""Interleaved rotary vs complex-number rotation of adjacent pairs, the fast path vs the reference, and the
cos/sin table."""

from __future__ import annotations

import math

import pytest
import torch

from libs.kernels.rotary import (
    apply_rotary_interleaved,
    apply_rotary_interleaved_reference,
    apply_rotary_qk,
    prepare_rotation,
    rope_cos_sin_cache,
    rotary_rotation,
)


def complex_rotary(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Pair (x[2i], x[2i+1]) is the complex number x[2i] + j*x[2i+1], multiplied by e^(j*pos*f_i)."""
    head_dim = x.shape[-1]
    freqs = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.double()[:, None] * freqs[None, :]  # [num_tokens, head_dim / 2]
    rotation = torch.polar(torch.ones_like(angles), angles)[:, None, :]  # [num_tokens, 1, head_dim / 2]
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], head_dim // 2, 2).contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2)


def test_cache_layout_is_cos_then_sin() -> None:
    cache = rope_cos_sin_cache(head_dim=8, max_positions=5, base=10000.0, dtype=torch.float32)
    assert cache.shape == (5, 8)
    p, i = 3, 1
    angle = p * 10000.0 ** (-2 * i / 8)
    assert cache[p, i].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert cache[p, 4 + i].item() == pytest.approx(math.sin(angle), abs=1e-6)
    assert torch.equal(cache[0, :4], torch.ones(4)) and torch.equal(cache[0, 4:], torch.zeros(4))


@pytest.mark.parametrize(
    ("num_heads", "head_dim", "base"), [(1, 2, 10000.0), (3, 64, 100000.0), (9, 16, 500.0)]
)
def test_matches_complex_rotation(num_heads: int, head_dim: int, base: float) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, num_heads, head_dim, generator=g)
    positions = torch.tensor([0, 1, 2, 7, 100, 4095, 3, 3, 8191, 42, 5])
    cache = rope_cos_sin_cache(head_dim, 8192, base, torch.float32)
    out = apply_rotary_interleaved(x, positions, cache)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), complex_rotary(x, positions, base), atol=1e-5, rtol=1e-5)


def test_position_zero_is_identity_and_norm_is_preserved() -> None:
    x = torch.randn(4, 2, 8)
    cache = rope_cos_sin_cache(8, 16, 10000.0, torch.float32)
    assert torch.equal(apply_rotary_interleaved(x, torch.zeros(4, dtype=torch.long), cache), x)
    rotated = apply_rotary_interleaved(x, torch.tensor([1, 5, 9, 15]), cache)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))


def test_relative_position_property() -> None:
    # <rope(q, m), rope(k, n)> depends only on m - n: the reason rope exists.
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 1, 32, generator=g), torch.randn(1, 1, 32, generator=g)
    cache = rope_cos_sin_cache(32, 64, 10000.0, torch.float32)

    def score(m: int, n: int) -> float:
        rq = apply_rotary_interleaved(q, torch.tensor([m]), cache)
        rk = apply_rotary_interleaved(k, torch.tensor([n]), cache)
        return float((rq * rk).sum())

    assert score(10, 3) == pytest.approx(score(40, 33), abs=1e-4)


def test_bf16_input_keeps_dtype() -> None:
    x = torch.randn(3, 2, 16).bfloat16()
    cache = rope_cos_sin_cache(16, 8, 10000.0, torch.float32)
    out = apply_rotary_interleaved(x, torch.tensor([1, 2, 3]), cache)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.double(), complex_rotary(x.float(), torch.tensor([1, 2, 3]), 10000.0), atol=3e-2, rtol=1e-2
    )


def test_odd_head_dim_rejected() -> None:
    with pytest.raises(ValueError, match="even"):
        rope_cos_sin_cache(7, 4, 10000.0, torch.float32)


# --- fast path vs reference -----------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [1, 8, 64, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_path_matches_reference_on_fused_qkv_views(num_tokens: int, dtype: torch.dtype) -> None:
    # llama.py rotates q and k as strided views into one fused qkv projection output.
    g = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, 9 * 64 + 2 * 3 * 64, generator=g).to(dtype)
    q = qkv[:, : 9 * 64].view(num_tokens, 9, 64)
    k = qkv[:, 9 * 64 : 12 * 64].view(num_tokens, 3, 64)
    positions = torch.randint(0, 8192, (num_tokens,), generator=g)
    cache = rope_cos_sin_cache(64, 8192, 100000.0, torch.float32)
    for x in (q, k):
        out = apply_rotary_interleaved(x, positions, cache)
        assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
        torch.testing.assert_close(
            out, apply_rotary_interleaved_reference(x, positions, cache), atol=1e-6, rtol=0
        )


def test_fast_path_copes_with_odd_offsets_and_strides() -> None:
    # view_as_complex needs even offsets and strides; views without them must still work.
    g = torch.Generator().manual_seed(9)
    odd_offset = torch.randn(129, generator=g)[1:].view(4, 1, 32)
    odd_stride = torch.randn(4, 33, generator=g)[:, :32].view(4, 1, 32)
    even_view = torch.randn(4, 2, 48, generator=g)[:, :, 8:40]
    cache = rope_cos_sin_cache(32, 16, 10000.0, torch.float32)
    positions = torch.tensor([0, 3, 7, 15])
    for x in (odd_offset, odd_stride, even_view):
        expected = apply_rotary_interleaved_reference(x, positions, cache)
        torch.testing.assert_close(apply_rotary_interleaved(x, positions, cache), expected)


# --- q and k together -----------------------------------------------------------------------


def fused_qkv_views(num_tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, 9, 64] and k [n, 3, 64] as llama.py has them: strided views into one qkv output."""
    qkv = torch.randn(num_tokens, 15 * 64, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return qkv[:, : 9 * 64].view(num_tokens, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(num_tokens, 3, 64)


@pytest.mark.parametrize("num_tokens", [1, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_is_bitwise_the_single_tensor_path(
    num_tokens: int, dtype: torch.dtype, extension_off: None
) -> None:
    # the torch route (the CPU extension's fp32 kernel: tests/unit/kernels/test_cpu_pointwise.py)
    q, k = fused_qkv_views(num_tokens, dtype, seed=num_tokens)
    positions = torch.randint(0, 8192, (num_tokens,), generator=torch.Generator().manual_seed(1))
    cache = rope_cos_sin_cache(64, 8192, 100000.0, torch.float32)
    rotation = prepare_rotation(positions, cache, dtype)
    assert rotation is not None and rotation.shape == (num_tokens, 1, 32)
    for shared in (None, rotation):  # built inside, or once per step and passed down
        rq, rk = apply_rotary_qk(q, k, positions, cache, shared)
        assert torch.equal(rq, apply_rotary_interleaved(q, positions, cache))
        assert torch.equal(rk, apply_rotary_interleaved(k, positions, cache))
        assert rq.shape == q.shape and rk.shape == k.shape and rq.dtype == rk.dtype == dtype
        torch.testing.assert_close(
            rk, apply_rotary_interleaved_reference(k, positions, cache), atol=1e-6, rtol=0
        )


def test_qk_rejects_mixed_dtypes() -> None:
    cache = rope_cos_sin_cache(8, 4, 10000.0, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        apply_rotary_qk(torch.randn(2, 1, 8), torch.randn(2, 1, 8).bfloat16(), torch.tensor([0, 1]), cache)


def test_rotation_is_the_cache_as_complex() -> None:
    cache = rope_cos_sin_cache(8, 16, 10000.0, torch.float32)
    rotation = rotary_rotation(torch.tensor([3, 0]), cache)
    assert rotation.dtype == torch.complex64
    assert torch.equal(torch.view_as_real(rotation[0, 0]), torch.stack([cache[3, :4], cache[3, 4:]], -1))


# --- CUDA -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flashinfer_rotary_matches_reference() -> None:
    pytest.importorskip("flashinfer")
    g = torch.Generator().manual_seed(10)
    qkv = torch.randn(37, 15 * 64, generator=g).bfloat16().cuda()
    positions = torch.randint(0, 4096, (37,), generator=g).cuda()
    cache = rope_cos_sin_cache(64, 4096, 100000.0, torch.float32).cuda()
    for x in (qkv[:, : 9 * 64].view(37, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(37, 3, 64)):
        out = apply_rotary_interleaved(x, positions, cache)
        expected = apply_rotary_interleaved_reference(x, positions, cache)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flashinfer_rotary_qk_matches_reference() -> None:
    pytest.importorskip("flashinfer")
    q, k = (t.cuda() for t in fused_qkv_views(37, torch.bfloat16, seed=11))
    positions = torch.randint(0, 4096, (37,), generator=torch.Generator().manual_seed(12)).cuda()
    cache = rope_cos_sin_cache(64, 4096, 100000.0, torch.float32).cuda()
    assert prepare_rotation(positions, cache, torch.bfloat16) is None  # flashinfer needs none
    rq, rk = apply_rotary_qk(q, k, positions, cache)
    assert rq.shape == q.shape and rk.shape == k.shape
    for out, x in ((rq, q), (rk, k)):
        expected = apply_rotary_interleaved_reference(x, positions, cache)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=1e-2)
