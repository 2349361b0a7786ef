"""linear (the weight-major product on fp32 CPU) vs x @ W^T in fp64, at every row count a step has,
and which of the two paths each input takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import libs.kernels.linear as linear_module
from libs.kernels.linear import (
    WEIGHT_MAJOR_MAX_ROWS,
    Linear,
    linear,
    linear_reference,
    linear_weight_major,
)


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 8, 9, 13, 16, 17, 64])  # padded above 8
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


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The path each call of ``linear`` takes, in order (the two agree too closely to tell apart)."""
    taken: list[str] = []
    weight_major, plain = linear_module.linear_weight_major, F.linear

    def record_weight_major(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        taken.append("weight-major")
        return weight_major(x, weight, bias)

    def record_plain(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        taken.append("F.linear")
        return plain(x, weight, bias)

    monkeypatch.setattr(linear_module, "linear_weight_major", record_weight_major)
    monkeypatch.setattr(F, "linear", record_plain)  # the module linear.py calls it through
    return taken


def test_dispatch_by_rows_and_dtype(paths: list[str]) -> None:
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(24, 32, generator=g)
    for num_rows in (1, WEIGHT_MAJOR_MAX_ROWS, WEIGHT_MAJOR_MAX_ROWS + 1):
        x = torch.randn(num_rows, 32, generator=g)
        torch.testing.assert_close(linear(x, weight), x @ weight.t(), atol=1e-5, rtol=1e-5)
    x = torch.randn(2, 3, 32, generator=g)  # leading dims count as rows
    assert linear(x, weight).shape == (2, 3, 24)
    linear(x.bfloat16(), weight.bfloat16())  # bf16 keeps F.linear
    out = linear(torch.randn(0, 32), weight)  # empty input
    assert out.shape == (0, 24)
    assert paths == ["weight-major"] * 2 + ["F.linear"] + ["weight-major"] + ["F.linear"] * 2


def test_linear_module_is_a_drop_in_nn_linear(paths: list[str]) -> None:
    torch.manual_seed(0)
    plain = nn.Linear(16, 8)
    ours = Linear(16, 8)
    ours.load_state_dict(plain.state_dict())
    assert isinstance(ours, nn.Linear) and ours.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(5, 16)
    expected = x @ plain.weight.t() + plain.bias
    torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)
    assert paths == ["weight-major"]  # nn.Linear's own forward would call F.linear
