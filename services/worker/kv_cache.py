"""The worker's physical KV pages and the per-step AttentionFn that reads and writes them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from libs.kernels.paged_attention import AttentionBackend


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * element_size


class KVCache:
    """Per layer, key and value pages: ``[num_blocks, block_size, num_kv_heads, head_dim]`` each.

    Zeroed, not empty: a batched decode may read padding slots that were never written, and
    masked-out garbage can still be NaN, which survives a softmax weight of 0.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, layout.num_kv_heads, layout.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]


@dataclass(frozen=True, slots=True)
class StepAttention:
    """The AttentionFn of one step: the model calls it once per layer; the backend is planned."""

    backend: AttentionBackend
    kv_cache: KVCache

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        return self.backend.forward(q, k, v, self.kv_cache.k[layer_idx], self.kv_cache.v[layer_idx])
