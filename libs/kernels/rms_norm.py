"""RMSNorm reference ops in plain torch: plain, and fused with the residual add."""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Root-mean-square norm over the last dim, computed in fp32 and cast back to x.dtype.

    x: [..., hidden]; weight: [hidden]; returns [..., hidden].
    """
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    normed = x32 * torch.rsqrt(variance + eps)
    # Apply the weight in fp32 too so a bf16 model rounds once, at the end.
    return (normed * weight.float()).to(x.dtype)


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`residual + x`, and its norm: the pre-norm step between two sub-layers.

    x, residual: [..., hidden]; weight: [hidden]. Returns (normed in x.dtype, new_residual in
    residual.dtype); the inputs are not modified. The sum is taken in fp32, so a caller that keeps
    the residual stream in fp32 under a bf16 model loses nothing in the add (llama models carry
    outlier channels in the thousands, where bf16's step is 8-128).
    """
    new_residual = (x.float() + residual.float()).to(residual.dtype)
    return rms_norm(new_residual, weight, eps).to(x.dtype), new_residual
