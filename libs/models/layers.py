"""Layers every decoder family here shares: RMSNorm (fused with the residual add) and the SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from libs.kernels.activation import silu_and_mul
from libs.kernels.rms_norm import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(x + residual), x + residual)."""
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class GatedMLP(nn.Module):
    """down(silu(gate x) * up x), with gate and up fused into one projection."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        super().__init__()
        # One fused projection; rows are [gate | up], the order silu_and_mul expects.
        # Typed nn.Module: quantize_model swaps in packed layers.
        self.gate_up_proj: nn.Module = nn.Linear(
            hidden_size, 2 * intermediate_size, bias=False, dtype=dtype, device=device
        )
        self.down_proj: nn.Module = nn.Linear(
            intermediate_size, hidden_size, bias=False, dtype=dtype, device=device
        )

    def forward(self, x: Tensor) -> Tensor:
        gate_up: Tensor = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        out: Tensor = self.down_proj(silu_and_mul(gate_up))
        return out
