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
    batch_invariant_products,
    linear,
    linear_reference,
    linear_weight_major,
)


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 8, 9, 13, 16, 17, 64])  # padded: 1, and above 8
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


@pytest.mark.parametrize(("n", "k"), [(576, 1536), (70, 40), (3, 17), (130, 576)])
def test_batch_invariant_bf16_linear(n: int, k: int) -> None:
    """Under batch_invariant_products a bf16 row's output has the same bits alone and in batches
    of any size (tiles of 4 rows x 4 features, partial ones, features past a multiple of 4 or 64,
    K past a multiple of the vector width), and equals F.linear's to bf16 rounding."""
    g = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(256, k, generator=g).bfloat16()
    singles = [(i, i + 1) for i in range(32)]  # a library's flips are rare: many rows alone
    with batch_invariant_products():
        whole = linear(x, weight)
        for start, end in [(0, 2), (1, 4), (3, 8), (5, 10), (0, 37), (36, 37), (100, 256), *singles]:
            assert torch.equal(linear(x[start:end], weight), whole[start:end]), (start, end)
        with_bias = linear(x[:5], weight, bias)
    reference = F.linear(x.float(), weight.float())
    assert whole.dtype == torch.bfloat16
    torch.testing.assert_close(whole.float(), reference, atol=2e-2 * k**0.5, rtol=1e-2)
    assert with_bias.dtype == torch.bfloat16
    torch.testing.assert_close(with_bias.float(), whole[:5].float() + bias.float(), atol=0.25, rtol=2**-7)
    assert not linear_module._products.batch_invariant  # the context restores the mode


def test_batch_invariant_products_leave_other_dtypes_alone(paths: list[str]) -> None:
    g = torch.Generator().manual_seed(9)
    weight = torch.randn(24, 32, generator=g)
    with batch_invariant_products():
        linear(torch.randn(3, 32, generator=g), weight)
    assert paths == ["weight-major"]
