"""FP8 (e4m3) block-scaled weights as DeepSeek ships them: dequantize, and quantize for test checkpoints.

A quantized Linear stores ``weight`` [M, N] float8_e4m3fn and ``weight_scale_inv`` [ceil(M/b),
ceil(N/b)] float32 (b = 128 in V3's ``weight_block_size``): W[i, j] = q[i, j] * s[i // b, j // b].
Edge blocks are partial: their scale covers only the rows and columns that exist (a reader that
derives b from M // scale_rows mis-scales them; transformers' CPU path does).
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def _expand_scales(scale_inv: Tensor, shape: tuple[int, int], block: tuple[int, int]) -> Tensor:
    rows, cols = shape
    return scale_inv.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]


def check_block_scales(
    weight_shape: tuple[int, ...], scale_shape: tuple[int, ...], block: tuple[int, int]
) -> str | None:
    """Why ``scale_shape`` is not the scale grid of ``weight_shape`` in ``block`` blocks, or None."""
    if len(weight_shape) != 2:
        return f"an FP8 weight must be 2-D, got {list(weight_shape)}"
    expected = tuple(-(-dim // b) for dim, b in zip(weight_shape, block, strict=True))
    if tuple(scale_shape) != expected:
        grid = f"the {list(block)} grid of {list(weight_shape)} ({list(expected)})"
        return f"weight_scale_inv {list(scale_shape)} is not {grid}"
    return None


def dequantize_fp8_block(
    weight: Tensor,
    scale_inv: Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """weight [M, N] float8_e4m3fn, scale_inv [ceil(M/b0), ceil(N/b1)] -> [M, N] in ``dtype`` (fp32 math)."""
    why = check_block_scales(tuple(weight.shape), tuple(scale_inv.shape), block)
    if why is not None:
        raise ValueError(why)
    scales = _expand_scales(scale_inv.float(), (weight.shape[0], weight.shape[1]), block)
    return (weight.float() * scales).to(dtype)


def dequantize_fp8_block_reference(weight: Tensor, scale_inv: Tensor, block: tuple[int, int]) -> Tensor:
    """The same, one block at a time: the plain reference the fast path is tested against."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    for bi in range(scale_inv.shape[0]):
        for bj in range(scale_inv.shape[1]):
            rows = slice(bi * block[0], (bi + 1) * block[0])
            cols = slice(bj * block[1], (bj + 1) * block[1])
            out[rows, cols] = weight[rows, cols].float() * scale_inv[bi, bj].float()
    return out


def quantize_fp8_block(weight: Tensor, block: tuple[int, int] = (128, 128)) -> tuple[Tensor, Tensor]:
    """[M, N] -> (float8_e4m3fn [M, N], scale_inv [ceil(M/b0), ceil(N/b1)] fp32): amax/448 per
    block, over the rows and columns the block has (as DeepSeek's conversion pads with zeros)."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid[0], block[0], grid[1], block[1])
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / FP8_E4M3_MAX).clamp(min=1e-12)
    quantized = (weight.float() / _expand_scales(scale_inv, (rows, cols), block)).to(torch.float8_e4m3fn)
    return quantized, scale_inv
