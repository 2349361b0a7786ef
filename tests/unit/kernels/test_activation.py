"""silu_and_mul vs the SwiGLU formula on a concatenated [gate | up] tensor."""

from __future__ import annotations

import torch

from libs.kernels.activation import silu_and_mul


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
