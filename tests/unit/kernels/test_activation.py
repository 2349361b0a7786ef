"""silu_and_mul vs the SwiGLU formula on a concatenated [gate | up] tensor."""

from __future__ import annotations

import pytest
import torch

from libs.kernels.activation import silu_and_mul, silu_and_mul_reference


def test_matches_swiglu_formula() -> None:
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(5, 24, generator=g), torch.randn(5, 24, generator=g)
    out = silu_and_mul(torch.cat([gate, up], dim=-1))
    expected = gate.double() / (1 + torch.exp(-gate.double())) * up.double()
    assert out.shape == (5, 24)
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=1e-6)


def test_leading_dims_and_dtype_preserved() -> None:
    x = torch.randn(2, 3, 16).bfloat16()
    out = silu_and_mul(x)
    assert out.shape == (2, 3, 8) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_matches_reference_on_cpu(dtype: torch.dtype) -> None:
    x = torch.randn(7, 2 * 1536, generator=torch.Generator().manual_seed(1)).to(dtype)
    if dtype == torch.float32:  # the CPU extension's kernel: its exp is a polynomial
        torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(silu_and_mul(x), silu_and_mul_reference(x))


def test_without_the_extension_the_reference_runs(extension_off: None) -> None:
    x = torch.randn(7, 2 * 1536, generator=torch.Generator().manual_seed(1))
    assert torch.equal(silu_and_mul(x), silu_and_mul_reference(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flashinfer_silu_and_mul_matches_reference() -> None:
    pytest.importorskip("flashinfer")
    x = torch.randn(37, 2 * 1536, generator=torch.Generator().manual_seed(2)).bfloat16().cuda()
    out = silu_and_mul(x)
    assert out.shape == (37, 1536) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), silu_and_mul_reference(x).float(), atol=2e-2, rtol=1e-2)
