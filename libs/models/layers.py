"""What every decoder family here shares: RMSNorm (fused with the residual add), the SwiGLU MLP,
and the causal LM's shell (embedding, head, rotary table, dtype and device)."""

from __future__ import annotations

import abc

import torch
from torch import Tensor, nn

from libs.kernels.activation import silu_and_mul
from libs.kernels.linear import Linear, linear
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
        self.gate_up_proj: nn.Module = Linear(
            hidden_size, 2 * intermediate_size, bias=False, dtype=dtype, device=device
        )
        self.down_proj: nn.Module = Linear(
            intermediate_size, hidden_size, bias=False, dtype=dtype, device=device
        )

    def forward(self, x: Tensor) -> Tensor:
        gate_up: Tensor = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        out: Tensor = self.down_proj(silu_and_mul(gate_up))
        return out


class CausalLMBase(nn.Module, abc.ABC):
    """The parts of a decoder-only LM that do not depend on its blocks. Subclasses set
    ``embed_tokens`` and ``lm_head`` (None: tied to the embeddings) and build their rotary table
    in ``_build_rope_cache``; ``cos_sin_cache`` is registered non-persistent (derived, fp32)."""

    embed_tokens: nn.Embedding
    lm_head: nn.Module | None
    cos_sin_cache: Tensor

    @abc.abstractmethod
    def _build_rope_cache(self, device: torch.device | None) -> Tensor: ...

    def reset_rope_cache(self, device: torch.device | str) -> None:
        """Rebuild the rotary table on `device` (needed after meta-device construction)."""
        self.cos_sin_cache = self._build_rope_cache(torch.device(device))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden: [n, hidden_size] -> logits [n, vocab_size] in fp32 (matmul in the model dtype)."""
        if self.lm_head is not None:
            logits: Tensor = self.lm_head(hidden)
            return logits.float()
        return linear(hidden, self.embed_tokens.weight).float()
