"""The CPU extension's row-wise kernels (csrc/cpu_pointwise.cpp) against their torch references:
RMSNorm plain and after the residual add, the interleaved rotary rotation of q and k, and
silu(gate) * up; at one token and at enough tokens to run on every thread, at widths past the last
full vector, on strided views; each row alone equals itself in a batch, bit for bit; bad inputs
are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from libs.kernels import cpu_ext
from libs.kernels.activation import silu_and_mul_reference
from libs.kernels.rms_norm import fused_add_rms_norm_reference, rms_norm_reference
from libs.kernels.rotary import apply_rotary_interleaved_reference, rope_cos_sin_cache

TOKENS = [1, 3, 300]  # 300 x 576: rows split across threads


def kernels() -> Any:
    ops = cpu_ext.ops()
    assert ops is not None  # the extension builds wherever the tests run
    return ops


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("hidden", [576, 37])
def test_rms_norms_match_the_references(num_tokens: int, hidden: int) -> None:
    x = randn(num_tokens, hidden, seed=1, scale=40)
    residual = randn(num_tokens, hidden, seed=2, scale=300)
    weight = randn(hidden, seed=3)
    x_before, residual_before = x.clone(), residual.clone()
    out = kernels().rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-5), rtol=1e-5, atol=1e-5)
    normed, new_residual = kernels().add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, ref_residual)  # one fp32 add: exact in both
    torch.testing.assert_close(normed, ref_normed, rtol=1e-5, atol=1e-5)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_any_rank_strided_rows_and_zeros() -> None:
    base = randn(5, 2 * 576, seed=4)
    weight = randn(576, seed=5)
    # rows 1152 apart (read in place), columns 2 apart and a 3-D view (copied first), one vector
    for x in (base[:, 576:], base[:, ::2], base.view(5, 2, 576)[:, 1:], base[0, :576]):
        out = kernels().rms_norm(x, weight, 1e-6)
        assert out.shape == x.shape
        torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-6))
        normed, new_residual = kernels().add_rms_norm(x, x, weight, 1e-6)
        torch.testing.assert_close(normed, rms_norm_reference(2 * x, weight, 1e-6))
        assert torch.equal(new_residual, 2 * x)
    strided_weight = randn(2 * 576, seed=7)[::2]
    torch.testing.assert_close(
        kernels().rms_norm(base[:, 576:], strided_weight, 1e-6),
        rms_norm_reference(base[:, 576:], strided_weight, 1e-6),
    )
    gate_up = randn(2, 3, 2 * 13, seed=6)[:, 1:]
    torch.testing.assert_close(
        kernels().silu_mul(gate_up), silu_and_mul_reference(gate_up), rtol=1e-6, atol=1e-6
    )
    assert torch.equal(kernels().rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6), torch.zeros(2, 8))


@pytest.mark.parametrize("num_tokens", TOKENS)
def test_rotary_matches_the_reference_on_fused_qkv_views(num_tokens: int) -> None:
    qkv = randn(num_tokens, 15 * 64, seed=num_tokens)  # [q: 9 heads | k: 3 | v: 3] as llama.py has it
    q = qkv[:, : 9 * 64].view(num_tokens, 9, 64)
    k = qkv[:, 9 * 64 : 12 * 64].view(num_tokens, 3, 64)
    positions = torch.randint(0, 8192, (num_tokens,), generator=torch.Generator().manual_seed(7))
    cache = rope_cos_sin_cache(64, 8192, 100000.0, torch.float32)
    rq, rk = kernels().rotary_qk(q, k, torch.stack([positions, positions], 1)[:, 0], cache)  # a strided view
    assert rq.is_contiguous() and rq.shape == q.shape and rk.shape == k.shape
    torch.testing.assert_close(rq, apply_rotary_interleaved_reference(q, positions, cache), atol=1e-6, rtol=0)
    torch.testing.assert_close(rk, apply_rotary_interleaved_reference(k, positions, cache), atol=1e-6, rtol=0)


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("ffn", [1536, 13])
def test_silu_mul_matches_the_reference(num_tokens: int, ffn: int) -> None:
    gate_up = randn(num_tokens, 2 * ffn, seed=ffn, scale=4)
    gate_up[0, :3] = torch.tensor([-200.0, 200.0, 0.0])  # exp's argument past fp32's range: capped
    out = kernels().silu_mul(gate_up)
    torch.testing.assert_close(out, silu_and_mul_reference(gate_up), rtol=1e-6, atol=1e-6)
    assert torch.isfinite(out).all()


def test_each_row_alone_equals_itself_in_a_batch() -> None:
    ops = kernels()
    x, residual, weight = randn(300, 576, seed=8), randn(300, 576, seed=9), randn(576, seed=10)
    qkv = randn(300, 15 * 64, seed=11)
    q, k = qkv[:, :576].view(300, 9, 64), qkv[:, 576:768].view(300, 3, 64)
    positions = torch.arange(300)
    cache = rope_cos_sin_cache(64, 512, 10000.0, torch.float32)
    together = (
        ops.rms_norm(x, weight, 1e-5),
        *ops.add_rms_norm(x, residual, weight, 1e-5),
        *ops.rotary_qk(q, k, positions, cache),
        ops.silu_mul(qkv),
    )
    for i in (0, 151, 299):
        alone = (
            ops.rms_norm(x[i : i + 1], weight, 1e-5),
            *ops.add_rms_norm(x[i : i + 1], residual[i : i + 1], weight, 1e-5),
            *ops.rotary_qk(q[i : i + 1], k[i : i + 1], positions[i : i + 1], cache),
            ops.silu_mul(qkv[i : i + 1]),
        )
        for batched, single in zip(together, alone, strict=True):
            assert torch.equal(batched[i : i + 1], single)


def test_bad_inputs_are_refused() -> None:
    ops = kernels()
    cache = rope_cos_sin_cache(64, 16, 10000.0, torch.float32)
    q, k = randn(2, 9, 64, seed=12), randn(2, 3, 64, seed=13)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rotary_qk(q, k, torch.tensor([0, 16]), cache)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rotary_qk(q, k, torch.tensor([-1, 0]), cache)
    with pytest.raises(RuntimeError, match="int64"):
        ops.rotary_qk(q, k, torch.tensor([0, 1], dtype=torch.int32), cache)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(randn(2, 8, seed=14), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(randn(2, 8, seed=14).bfloat16(), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="shape"):
        ops.add_rms_norm(randn(2, 8, seed=15), randn(3, 8, seed=16), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="even"):
        ops.silu_mul(randn(2, 7, seed=17))
