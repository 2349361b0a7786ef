"""The CPU extension's int8 linear (fp32 activations) against its dequantizing reference, at the
row counts and shapes its tiles and vector loops split on, and the fallback with the extension off."""

from __future__ import annotations

import pytest
import torch

from libs.kernels import cpu_ext
from libs.kernels.int8_linear import int8_linear, int8_linear_reference


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


@pytest.mark.parametrize(("n", "k"), [(7, 576), (1030, 520), (5, 37), (9, 8)])
def test_one_row_features_are_computed_alone(n: int, k: int) -> None:
    # One row reads two weight rows side by side (two memory streams); each output is still that
    # feature's own dot product, bit for bit the feature computed alone (where nothing pairs it).
    weight, scales = quantized(n, k, seed=5)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(6))
    together = int8_linear(x, weight, scales)
    alone = torch.cat([int8_linear(x, weight[i : i + 1], scales[i : i + 1]) for i in range(n)], dim=1)
    assert torch.equal(together, alone)


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
