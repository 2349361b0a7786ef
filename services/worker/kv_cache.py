"""The worker's physical KV pages, laid out by the model's KVSpec, and the per-step attention
functions that read and write them (one per KV kind)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from libs.kernels.mla_attention import MLAWeights, PagedMLABackend
from libs.kernels.paged_attention import AttentionBackend
from libs.kvstore.kv_spec import KVSpec


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVBlocks(Protocol):
    """Whole KV pages by block id, as the tiers and handoffs move them: a KVCache, or a
    tensor-parallel worker's view of every rank's pages."""

    kv_spec: KVSpec  # the whole model's (every rank's heads)
    num_blocks: int
    block_size: int
    bytes_per_token: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]: ...

    def gather_blocks(self, block_ids: Sequence[int]) -> Tensor: ...

    def scatter_blocks(self, block_ids: Sequence[int], payload: Tensor) -> None: ...


class KVCache:
    """Per plane and layer, one page tensor ``[num_blocks, block_size, num_kv_heads, head_dim]``:
    ``planes[0]`` the keys and ``planes[1]`` the values (MHA), or ``planes[0]`` the latent
    entries (MLA, one head of kv_lora_rank + rope_dim).

    Zeroed, not empty: a batched decode may read padding slots that were never written, and
    masked-out garbage can still be NaN, which survives a softmax weight of 0.
    """

    def __init__(
        self,
        kv_spec: KVSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.kv_spec = kv_spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.bytes_per_token = kv_spec.bytes_per_token(element_size(dtype))  # what the worker reports
        shape = kv_spec.page_shape(num_blocks, block_size)
        self.planes = [
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(kv_spec.num_layers)]
            for _ in range(kv_spec.num_planes)
        ]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return self.kv_spec.block_shape(self.block_size)

    def _index(self, block_ids: Sequence[int]) -> Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def gather_blocks(self, block_ids: Sequence[int]) -> Tensor:
        """A copy of the pages ``block_ids``: ``[n, *block_shape]`` on this cache's device; later
        writes to the pages leave it unchanged."""
        index = self._index(block_ids)
        out = torch.empty((len(index), *self.block_shape), dtype=self.dtype, device=self.device)
        for plane, pages in enumerate(self.planes):
            for layer, page in enumerate(pages):
                out[:, layer, plane] = page.index_select(0, index)
        return out

    def scatter_blocks(self, block_ids: Sequence[int], payload: Tensor) -> None:
        """Overwrite the pages ``block_ids`` with ``payload`` (``gather_blocks``'s shape and dtype,
        on any device)."""
        index = self._index(block_ids)
        if payload.shape != (len(index), *self.block_shape) or payload.dtype != self.dtype:
            raise ValueError(f"payload {tuple(payload.shape)} {payload.dtype} does not fit these pages")
        payload = payload.to(self.device)
        for plane, pages in enumerate(self.planes):
            for layer, page in enumerate(pages):
                page.index_copy_(0, index, payload[:, layer, plane])


@dataclass(frozen=True, slots=True)
class StepAttention:
    """The AttentionFn of one step (MHA / GQA): the model calls it once per layer; the backend is planned."""

    backend: AttentionBackend
    kv_cache: KVCache

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        keys, values = self.kv_cache.planes
        return self.backend.forward(q, k, v, keys[layer_idx], values[layer_idx])


@dataclass(frozen=True, slots=True)
class StepMLAAttention:
    """The MLAAttentionFn of one step: each layer's latent page seen as [num_blocks, block_size, width]."""

    backend: PagedMLABackend
    kv_cache: KVCache

    def __call__(
        self, layer_idx: int, q_nope: Tensor, q_pe: Tensor, latent: Tensor, k_pe: Tensor, weights: MLAWeights
    ) -> Tensor:
        page = self.kv_cache.planes[0][layer_idx]
        return self.backend.forward(
            q_nope, q_pe, latent, k_pe, weights, page.view(*page.shape[:2], page.shape[-1])
        )
