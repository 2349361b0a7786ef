"""rms_norm / fused_add_rms_norm against the textbook formula, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from libs.kernels.rms_norm import fused_add_rms_norm, rms_norm


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64, w64 = x.double(), weight.double()
    rms = torch.sqrt((x64 * x64).sum(-1, keepdim=True) / x.shape[-1] + eps)
    return x64 / rms * w64


@pytest.mark.parametrize("shape", [(1, 8), (5, 64), (2, 3, 576)])
def test_rms_norm_matches_formula_fp32(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3
    weight = torch.randn(shape[-1], generator=g)
    out = rms_norm(x, weight, 1e-5)
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out.double(), naive_rms_norm(x, weight, 1e-5), atol=1e-5, rtol=1e-5)


def test_rms_norm_bf16_returns_bf16_close_to_fp32() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 64, generator=g).bfloat16()
    weight = torch.randn(64, generator=g).bfloat16()
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_rms_norm(x, weight, 1e-6), atol=2e-2, rtol=1e-2)


def test_eps_dominates_for_zero_input() -> None:
    out = rms_norm(torch.zeros(2, 4), torch.ones(4), 1e-5)
    assert torch.equal(out, torch.zeros(2, 4))


@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_is_add_then_norm(residual_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 32, generator=g).bfloat16()
    residual = (torch.randn(6, 32, generator=g) * 100).to(residual_dtype)
    weight = torch.randn(32, generator=g).bfloat16()
    x_before, residual_before = x.clone(), residual.clone()

    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)

    assert normed.dtype == x.dtype and new_residual.dtype == residual_dtype
    expected_sum = (x.double() + residual.double()).to(residual_dtype)
    assert torch.equal(new_residual, expected_sum)
    torch.testing.assert_close(normed, rms_norm(expected_sum, weight, 1e-5).to(x.dtype))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs untouched
