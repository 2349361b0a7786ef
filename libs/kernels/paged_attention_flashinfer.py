"""The CUDA attention backend: flashinfer's paged prefill and decode kernels over the NHD cache.

flashinfer is imported lazily, in the backend's constructor: it has no CPU path and is an
optional dependency. The layout it plans from (the pages in use, in CSR form) is built on the host
by PagedAttentionMetadata.build, plain numpy and testable anywhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from libs.kernels.paged_attention import PagedAttentionMetadata, write_kv

# flashinfer's recommended size for the float workspace of its batch wrappers (split-kv partials).
_WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttentionBackend:
    """CUDA backend: flashinfer's paged prefill kernel for the prefill rows and its paged decode
    kernel for the decode rows, both planned once per step.

    flashinfer's causal mask aligns the last query with the last key (query i of a row sees keys
    up to kv_len - qo_len + i): the context-offset causal mask paged_attention.py defines.
    """

    def __init__(
        self, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> None:
        import flashinfer

        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype = dtype
        self.scale = head_dim**-0.5
        # One float workspace shared by both wrappers: they run one after the other on one stream.
        self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD")
        # Tensor cores: the prefill-kernel route for decode, which serves any query-group size.
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, kv_layout="NHD", use_tensor_cores=True
        )
        self._meta: PagedAttentionMetadata | None = None

    def plan(self, meta: PagedAttentionMetadata) -> None:
        # flashinfer's plan reads the layout on the host: the metadata's host arrays, so planning
        # copies nothing back from the device.
        kv_indptr, kv_indices, last_page_len = meta.kv_indptr, meta.kv_indices, meta.last_page_len
        split = meta.num_prefills
        # The leading arguments go by position: their names changed across flashinfer releases.
        heads = (self.num_heads, self.num_kv_heads, self.head_dim, meta.block_size)
        options: dict[str, Any] = {
            "sm_scale": self.scale,
            "q_data_type": self.dtype,
            "kv_data_type": self.dtype,
        }
        if split > 0:
            prefill_pages = int(kv_indptr[split])
            self._prefill.plan(
                meta.query_start_loc[: split + 1],
                kv_indptr[: split + 1],
                kv_indices[:prefill_pages],
                last_page_len[:split],
                *heads,
                causal=True,
                **options,
            )
        if split < meta.num_seqs:
            self._decode.plan(
                kv_indptr[split:] - kv_indptr[split],
                kv_indices[int(kv_indptr[split]) :],
                last_page_len[split:],
                *heads,
                **options,
            )
        self._meta = meta

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        meta = self._meta
        if meta is None:
            raise RuntimeError("forward() before plan()")
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        split = meta.num_prefill_tokens
        out = torch.empty_like(q)
        if meta.num_prefills > 0:
            out[:split] = self._prefill.run(q[:split], (k_cache, v_cache))
        if meta.num_prefills < meta.num_seqs:
            out[split:] = self._decode.run(q[split:], (k_cache, v_cache))
        return out
