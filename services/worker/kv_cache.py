"""The worker's physical KV pages and the per-step AttentionFn that reads and writes them."""

from __future__ import annotations

from collections.abc import Sequence
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

    def block_shape(self, block_size: int) -> tuple[int, int, int, int, int]:
        """Shape of one block's payload, the unit G2 holds and G3 stores:
        ``[num_layers, 2 (key, value), block_size, num_kv_heads, head_dim]``."""
        return (self.num_layers, 2, block_size, self.num_kv_heads, self.head_dim)


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
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_blocks, block_size, layout.num_kv_heads, layout.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return self.layout.block_shape(self.block_size)

    def _index(self, block_ids: Sequence[int]) -> Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def gather_blocks(self, block_ids: Sequence[int]) -> Tensor:
        """A copy of the pages ``block_ids``: ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]``
        on this cache's device; later writes to the pages leave it unchanged."""
        index = self._index(block_ids)
        out = torch.empty((len(index), *self.block_shape), dtype=self.dtype, device=self.device)
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            out[:, layer, 0] = k.index_select(0, index)
            out[:, layer, 1] = v.index_select(0, index)
        return out

    def scatter_blocks(self, block_ids: Sequence[int], payload: Tensor) -> None:
        """Overwrite the pages ``block_ids`` with ``payload`` (``gather_blocks``'s shape and dtype,
        on any device)."""
        index = self._index(block_ids)
        if payload.shape != (len(index), *self.block_shape) or payload.dtype != self.dtype:
            raise ValueError(f"payload {tuple(payload.shape)} {payload.dtype} does not fit these pages")
        payload = payload.to(self.device)
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            k.index_copy_(0, index, payload[:, layer, 0])
            v.index_copy_(0, index, payload[:, layer, 1])


@dataclass(frozen=True, slots=True)
class StepAttention:
    """The AttentionFn of one step: the model calls it once per layer; the backend is planned."""

    backend: AttentionBackend
    kv_cache: KVCache

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        return self.backend.forward(q, k, v, self.kv_cache.k[layer_idx], self.kv_cache.v[layer_idx])
