"""Rotary position embedding for the interleaved (GGUF/ggml) layout, in plain torch.

llama.cpp's converter permutes the rows of Q and K so that ggml's rope, which rotates adjacent
pairs (x[2i], x[2i+1]) by angle pos * base^(-2i/head_dim), gives the same result as HF's
rotate_half layout. Weights used as stored in the GGUF therefore need this interleaved rotation.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_cos_sin_cache(head_dim: int, max_positions: int, base: float, dtype: torch.dtype) -> Tensor:
    """cos and sin of every (position, pair) angle: [max_positions, head_dim] = cat(cos, sin).

    Row p holds cos(p * f_i) for i < head_dim/2 followed by sin(p * f_i), f_i = base^(-2i/head_dim).
    Angles are computed in fp64 so large positions keep their precision before the cast to dtype.
    """
    if head_dim % 2 != 0:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    positions = torch.arange(max_positions, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)  # [max_positions, head_dim / 2]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)


def apply_rotary_interleaved(x: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> Tensor:
    """Rotate each adjacent pair (x[..., 2i], x[..., 2i+1]) by its angle at each token's position.

    x: [num_tokens, num_heads, head_dim]; positions: [num_tokens] int64;
    cos_sin_cache: [max_positions, head_dim] from rope_cos_sin_cache. Returns a new tensor shaped
    and typed like x; the rotation itself runs in fp32.
    """
    half = x.shape[-1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions).float()  # [num_tokens, head_dim]
    cos = cos_sin[:, None, :half]  # [num_tokens, 1, head_dim / 2]
    sin = cos_sin[:, None, half:]
    pairs = x.float().reshape(*x.shape[:-1], half, 2)  # [num_tokens, num_heads, head_dim / 2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).to(x.dtype)
