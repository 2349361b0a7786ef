"""The CPU extension's int8 linear (fp32 activations) against its dequantizing reference, at the
row counts and shapes its tiles and vector loops split on, and the fallback with the extension off."""

from __future__ import annotations

import pytest
import torch

from libs.kernels import cpu_ext
from libs.kernels.int8_linear import (
    INT16_MIN_ROWS,
    int8_linear,
    int8_linear_int16_reference,
    int8_linear_reference,
    int16_products,
)


def quantized(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, generator=g) / 127 + 1e-3
    return weight, scales


@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 8, 9, 16, 23, 64])
@pytest.mark.parametrize(("n", "k"), [(192, 576), (48, 20), (3, 37), (1000, 8), (1030, 520)])
def test_matches_reference(num_rows: int, n: int, k: int) -> None:
    # 20 and 37: inner dims past the last full vector; (1030, 520): enough weights to run on every
    # thread, the features split unevenly
    assert cpu_ext.ops() is not None  # the extension builds wherever the tests run
    weight, scales = quantized(n, k, seed=num_rows)
    x = torch.randn(num_rows, k, generator=torch.Generator().manual_seed(n))
    out = int8_linear(x, weight, scales)
    assert out.shape == (num_rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, int8_linear_reference(x, weight, scales), rtol=1e-5, atol=1e-4)


def test_rows_are_computed_alone() -> None:
    # A row's output does not depend on which other rows share the call beyond summation order (no
    # cross-row mixing of tiles). Not to the bit: one row sums in another order than a tile's rows.
    weight, scales = quantized(64, 96, seed=1)
    x = torch.randn(11, 96, generator=torch.Generator().manual_seed(2))
    together = int8_linear(x, weight, scales)
    for i in (0, 7, 10):
        torch.testing.assert_close(together[i : i + 1], int8_linear(x[i : i + 1], weight, scales))


@pytest.mark.parametrize(("n", "k"), [(7, 576), (1030, 520), (5, 37), (9, 8), (6, 53), (4, 25)])
def test_one_row_features_are_computed_alone(n: int, k: int) -> None:
    # One row reads two weight rows side by side (two memory streams); each output is still that
    # feature's own dot product, bit for bit the feature computed alone (where nothing pairs it).
    weight, scales = quantized(n, k, seed=5)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(6))
    together = int8_linear(x, weight, scales)
    alone = torch.cat([int8_linear(x, weight[i : i + 1], scales[i : i + 1]) for i in range(n)], dim=1)
    assert torch.equal(together, alone)


@pytest.mark.parametrize("num_rows", [4, 5, 8, 23, 64])
@pytest.mark.parametrize(("n", "k"), [(192, 576), (48, 20), (3, 37), (1030, 520), (16, 8200)])
def test_int16_activations_match_their_reference(num_rows: int, n: int, k: int) -> None:
    # 20: no column rounded (fewer than 32); 37: a fp32 tail past 32; 8200: two int32 chunks.
    weight, scales = quantized(n, k, seed=num_rows + 7)
    x = torch.randn(num_rows, k, generator=torch.Generator().manual_seed(n + 1))
    x[1, k // 2] = 40.0  # a row whose spread is 40x its typical value
    out = int8_linear(x, weight, scales, int16_activations=True)
    exact = int8_linear_reference(x, weight, scales)
    atol = 2e-5 * float(exact.abs().max())  # fp32 sums: within their rounding of the largest outputs
    if not int16_products():  # a CPU without AVX-512 VNNI: the fp32 products
        torch.testing.assert_close(out, exact, rtol=1e-5, atol=atol)
        return
    torch.testing.assert_close(out, int8_linear_int16_reference(x, weight, scales), rtol=1e-5, atol=atol)
    # x rounded at 2^-16 of each row's largest value: far inside bf16's rounding of x.
    bound = x.abs().amax(dim=1, keepdim=True) / 32767 * (weight.float().abs() @ torch.ones(k))[None, :]
    assert ((out - exact).abs() <= bound * scales[None, :] + 1e-4).all()
    if k >= 32:
        assert not torch.equal(out, int8_linear(x, weight, scales))  # the int16 path ran


def test_int16_activations_leave_small_steps_and_odd_rows_alone() -> None:
    weight, scales = quantized(64, 576, seed=9)
    x = torch.randn(INT16_MIN_ROWS + 4, 576, generator=torch.Generator().manual_seed(10))
    few = x[: INT16_MIN_ROWS - 1]
    assert torch.equal(int8_linear(few, weight, scales, True), int8_linear(few, weight, scales))
    # A NaN, an infinity, a row of 1e-36 (32767 / max would overflow) and of denormals: each
    # such row gets the one-row fp32 product's own answer, the others theirs.
    x[1, 7], x[3, 9] = float("nan"), float("inf")
    x[4] *= 1e-36
    x[5] = torch.full((576,), 1e-40) * torch.sign(x[5])
    out = int8_linear(x, weight, scales, int16_activations=True)
    if not int16_products():  # the flag changes nothing there
        torch.testing.assert_close(out, int8_linear(x, weight, scales), rtol=0, atol=0, equal_nan=True)
    for row in (1, 3, 4, 5) if int16_products() else ():
        alone = int8_linear(x[row : row + 1], weight, scales)[0]
        torch.testing.assert_close(out[row], alone, rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(out).all(dim=1).tolist() == [True, False, True, False, True, True, True, True]
    assert (out[4].abs() > 0).all() and (out[4].abs() < 1e-32).all()
    clean = x[[0, 2, 6, 7]]
    torch.testing.assert_close(out[[0, 2, 6, 7]], int8_linear(clean, weight, scales, True), rtol=0, atol=0)


def test_non_contiguous_input_is_taken() -> None:
    weight, scales = quantized(32, 64, seed=3)
    x = torch.randn(64, 5).t()  # [5, 64], strided
    torch.testing.assert_close(int8_linear(x, weight, scales), int8_linear_reference(x, weight, scales))


def test_the_extension_refuses_wrong_inputs() -> None:
    ops = cpu_ext.ops()
    assert ops is not None
    weight, scales = quantized(16, 32, seed=4)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        ops.int8_linear(torch.randn(2, 31), weight, scales)
    with pytest.raises(RuntimeError, match="float32"):
        ops.int8_linear(torch.randn(2, 32).bfloat16(), weight, scales)
    with pytest.raises(RuntimeError, match="int8"):
        ops.int8_linear(torch.randn(2, 32), weight.float(), scales)


def test_without_the_extension_the_reference_runs(extension_off: None) -> None:
    assert cpu_ext.ops() is None
    weight, scales = quantized(16, 32, seed=5)
    x = torch.randn(3, 32)
    # bit-equal: the kernel would have summed in another order
    assert torch.equal(int8_linear(x, weight, scales), int8_linear_reference(x, weight, scales))
