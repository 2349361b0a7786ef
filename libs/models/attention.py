"""The attention contract between a model and whoever owns the KV cache, plus a cacheless reference."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class AttentionFn(Protocol):
    """Attention for one layer over a flat varlen batch of tokens.

    q: [num_tokens, num_heads, head_dim], k/v: [num_tokens, num_kv_heads, head_dim] (rope already
    applied); returns [num_tokens, num_heads, head_dim]. The implementation owns the KV cache (it
    stores k/v and attends over cached + new keys); the model never sees the cache.
    """

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class SingleSequenceCausalAttention:
    """AttentionFn for ONE sequence given whole, with no cache: causal SDPA over the given tokens.

    The reference for tests and for checking cache-backed implementations. Every token attends to
    itself and the tokens before it in the call; nothing is remembered between calls.
    """

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        del layer_idx  # no per-layer state
        return causal_attention(q, k, v)


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal SDPA of q over k/v with grouped KV heads; the last q token aligns with the last key.

    q: [num_q, num_heads, head_dim]; k, v: [num_kv, num_kv_heads, head_dim] with num_kv >= num_q
    (earlier keys are context, as in a cache). Returns [num_q, num_heads, head_dim].
    """
    num_q, num_heads, _ = q.shape
    num_kv, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    # Query head h reads KV head h // group (HF's repeat_kv order).
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, num_kv, head_dim]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    q = q.transpose(0, 1)  # [num_heads, num_q, head_dim]
    if num_q == num_kv:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        # Query i sits at key position (num_kv - num_q + i): it sees keys up to and including that.
        offset = num_kv - num_q
        mask = torch.ones(num_q, num_kv, dtype=torch.bool, device=q.device).tril(diagonal=offset)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(0, 1)  # [num_q, num_heads, head_dim]
