"""rms_norm / fused_add_rms_norm against the textbook formula and against their references, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from libs.kernels.rms_norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)


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


# --- fast path vs reference -----------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 576), (32, 576), (512, 576), (2, 3, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_fast_path_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(len(shape) + shape[0])
    x = (torch.randn(shape, generator=g) * 20).to(dtype)
    weight = torch.randn(shape[-1], generator=g).to(dtype)
    out, expected = rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:  # the same fp32 value up to accumulation order, then one rounding: at most one bf16 step
        torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=8e-3)


def test_rms_norm_fast_path_on_strided_input_and_fp64() -> None:
    g = torch.Generator().manual_seed(4)
    base = torch.randn(6, 2 * 64, generator=g)
    x = base[:, ::2]  # non-contiguous rows and columns
    weight = torch.randn(64, generator=g)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))
    x64 = x.double()
    out64 = rms_norm(x64, weight, 1e-6)
    assert out64.dtype == torch.float64
    torch.testing.assert_close(out64, rms_norm_reference(x64, weight, 1e-6))


@pytest.mark.parametrize(
    ("x_dtype", "residual_dtype"),
    [
        (torch.bfloat16, torch.float32),  # llama.py: bf16 hidden, fp32 residual stream
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),  # promotes: served by the reference
        (torch.float16, torch.bfloat16),
    ],
)
def test_fused_add_fast_path_matches_reference(x_dtype: torch.dtype, residual_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(33, 576, generator=g).to(x_dtype)
    residual = (torch.randn(33, 576, generator=g) * 300).to(residual_dtype)
    weight = torch.randn(576, generator=g).to(torch.bfloat16)
    x_before, residual_before = x.clone(), residual.clone()

    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-5)

    assert normed.dtype == x_dtype and new_residual.dtype == residual_dtype
    assert torch.equal(new_residual, ref_residual)  # the add is exact in both
    if x_dtype == torch.float32:
        torch.testing.assert_close(normed, ref_normed, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(normed.float(), ref_normed.float(), atol=1e-2, rtol=8e-3)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


# --- CUDA -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flashinfer_norms_match_reference() -> None:
    pytest.importorskip("flashinfer")
    g = torch.Generator().manual_seed(6)
    x = torch.randn(37, 576, generator=g).bfloat16().cuda()
    residual = (torch.randn(37, 576, generator=g) * 50).bfloat16().cuda()
    weight = torch.randn(576, generator=g).bfloat16().cuda()
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5), atol=2e-2, rtol=1e-2
    )
    # fused_add_rms_norm takes the torch path on CUDA too (no flashinfer kernel for it).
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, ref_residual, atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(normed, ref_normed, atol=2e-2, rtol=1e-2)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_path_is_bitwise_the_reference(dtype: torch.dtype, extension_off: None) -> None:
    """A bf16 model sits on logit near-ties: the torch fast path must not move a single ulp (the
    CPU extension's fp32 kernel sums in another order: tests/unit/kernels/test_cpu_pointwise.py)."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 576, generator=g) * 40).to(dtype)
    residual = torch.randn(37, 576, generator=g) * 300  # fp32, as the model keeps it
    weight = torch.randn(576, generator=g).to(dtype)
    assert torch.equal(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))
    out, res = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_res = fused_add_rms_norm_reference(x, residual, weight, 1e-5)
    assert torch.equal(out, ref_out) and torch.equal(res, ref_res)
