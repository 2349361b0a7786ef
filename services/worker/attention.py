"""Attention over the paged KV pool for one step's flat token layout.

Tokens of a step are laid out ``[prefill seq 0 tokens | prefill seq 1 tokens | ... | one token per
decode seq]``. Each layer call writes the step's k/v into the pool at ``slot_mapping``, then
- prefill: causal attention of each new sequence over its own tokens (no cached prefix yet);
- decode: every decode sequence's one query over its gathered pages, padded to the longest and
  masked, as one batched SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class KVPool:
    """Per-layer key and value pages: ``[num_slots, num_kv_heads, head_dim]`` each."""

    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> None:
        shape = (num_slots, num_kv_heads, head_dim)
        # Zeroed, not empty: decode pads its gather with real slots that may never have been
        # written, and masked-out garbage can still be NaN, which survives softmax weight 0.
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, slots=True)
class StepAttention:
    """The AttentionFn for one step (the model calls it once per layer)."""

    pool: KVPool
    slot_mapping: torch.Tensor  # [num_tokens] pool slot of each token's k/v
    prefill_spans: tuple[tuple[int, int], ...]  # (start, num_tokens) per prefill sequence
    num_prefill_tokens: int
    decode_slots: torch.Tensor | None  # [num_decode, max_len] pool slots (padding: any slot)
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_len] True where attended

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        k_pages, v_pages = self.pool.k[layer_idx], self.pool.v[layer_idx]
        k_pages.index_copy_(0, self.slot_mapping, k)
        v_pages.index_copy_(0, self.slot_mapping, v)
        out = torch.empty_like(q)
        for start, n in self.prefill_spans:
            end = start + n
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1).unsqueeze(0),  # [1, num_heads, n, head_dim]
                k[start:end].transpose(0, 1).unsqueeze(0),
                v[start:end].transpose(0, 1).unsqueeze(0),
                is_causal=True,
                enable_gqa=True,
            )
            out[start:end] = o[0].transpose(0, 1)
        if self.decode_slots is not None:
            p = self.num_prefill_tokens
            keys = k_pages[self.decode_slots].transpose(1, 2)  # [num_decode, num_kv_heads, max_len, head_dim]
            values = v_pages[self.decode_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[p:].unsqueeze(2), keys, values, attn_mask=self.decode_mask, enable_gqa=True
            )  # [num_decode, num_heads, 1, head_dim]
            out[p:] = o.squeeze(2)
        return out
