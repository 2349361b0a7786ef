"""FP8 e4m3 block dequantization against the per-block reference, on shapes that are not multiples
of the block (V3's kv_a_proj_with_mqa is [576, 7168] with a [5, 56] scale grid)."""

from __future__ import annotations

import pytest
import torch

from libs.models.fp8 import (
    FP8_E4M3_MAX,
    check_block_scales,
    dequantize_fp8_block,
    dequantize_fp8_block_reference,
    quantize_fp8_block,
)


@pytest.mark.parametrize("shape", [(576, 7168), (300, 200), (128, 128), (1, 129)])
def test_dequant_matches_the_per_block_reference(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape, generator=g) * 0.05).to(torch.float8_e4m3fn)
    grid = (-(-shape[0] // 128), -(-shape[1] // 128))
    scale_inv = torch.rand(grid, generator=g) + 0.5
    got = dequantize_fp8_block(weight, scale_inv, (128, 128), torch.float32)
    assert torch.equal(got, dequantize_fp8_block_reference(weight, scale_inv, (128, 128)))


def test_quantize_round_trip_scales_each_block_by_its_own_max() -> None:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(200, 300, generator=g)
    weight[130:, 260:] *= 100  # the edge block's scale must come from its own rows and columns
    quantized, scale_inv = quantize_fp8_block(weight)
    assert scale_inv.shape == (2, 3)
    assert scale_inv[1, 2] == pytest.approx(weight[128:, 256:].abs().max().item() / FP8_E4M3_MAX)
    back = dequantize_fp8_block(quantized, scale_inv, dtype=torch.float32)
    scale = scale_inv.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    # e4m3: relative error 2^-4 for normal values, absolute 2^-10 (times the scale) for subnormal ones
    assert ((back - weight).abs() <= weight.abs() / 16 + scale * 2**-10 + 1e-7).all()


def test_a_wrong_scale_grid_is_refused() -> None:
    assert check_block_scales((576, 7168), (5, 56), (128, 128)) is None
    assert "grid" in str(check_block_scales((576, 7168), (4, 56), (128, 128)))
    with pytest.raises(ValueError, match="grid"):
        dequantize_fp8_block(torch.zeros(576, 7168, dtype=torch.float8_e4m3fn), torch.ones(4, 56))
