"""linear (the weight-major product on fp32 CPU) vs x @ W^T in fp64, at every row count a step has."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from libs.kernels.linear import (
    WEIGHT_MAJOR_MAX_ROWS,
    Linear,
    linear,
    linear_reference,
    linear_weight_major,
)


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 8, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_weight_major_matches_fp64_product(num_rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(num_rows)
    x, weight = torch.randn(num_rows, 96, generator=g), torch.randn(40, 96, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    expected = x.double() @ weight.double().t() + (b.double() if b is not None else 0)
    out = linear_weight_major(x, weight, b)
    assert out.shape == (num_rows, 40) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out, linear_reference(x, weight, b), atol=1e-4, rtol=1e-5)


def test_leading_dims_and_dispatch() -> None:
    g = torch.Generator().manual_seed(5)
    x, weight = torch.randn(2, 3, 32, generator=g), torch.randn(24, 32, generator=g)
    out = linear(x, weight)
    assert out.shape == (2, 3, 24)
    assert torch.equal(out, linear_weight_major(x, weight))  # fp32 on CPU takes the weight-major path
    torch.testing.assert_close(out, linear_reference(x, weight), atol=1e-5, rtol=1e-5)
    many = torch.randn(WEIGHT_MAJOR_MAX_ROWS + 1, 32, generator=g)  # a prefill chunk keeps F.linear
    assert torch.equal(linear(many, weight), linear_reference(many, weight))
    bf16 = linear(x.bfloat16(), weight.bfloat16())  # bf16 keeps F.linear
    assert torch.equal(bf16, linear_reference(x.bfloat16(), weight.bfloat16()))


def test_linear_module_is_a_drop_in_nn_linear() -> None:
    torch.manual_seed(0)
    plain = nn.Linear(16, 8)
    ours = Linear(16, 8)
    ours.load_state_dict(plain.state_dict())
    assert isinstance(ours, nn.Linear) and ours.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(5, 16)
    torch.testing.assert_close(ours(x), plain(x), atol=1e-5, rtol=1e-5)
