"""Cacheless causal attention over one sequence: the reference every attention backend is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Causal SDPA of q over k/v with grouped KV heads; the last q token aligns with the last key.

    q: [num_q, num_heads, qk_dim]; k: [num_kv, num_kv_heads, qk_dim]; v: [num_kv, num_kv_heads,
    v_dim] with num_kv >= num_q (earlier keys are context, as in a cache). v_dim may differ from
    qk_dim (MLA). scale: the softmax scale, qk_dim ** -0.5 when None. Returns [num_q, num_heads, v_dim].
    """
    num_q, num_heads, _ = q.shape
    num_kv, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    # Query head h reads KV head h // group (HF's repeat_kv order).
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, num_kv, qk_dim]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, num_kv, v_dim]
    q = q.transpose(0, 1)  # [num_heads, num_q, qk_dim]
    if num_q == num_kv:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        # Query i sits at key position (num_kv - num_q + i): it sees keys up to and including that.
        offset = num_kv - num_q
        mask = torch.ones(num_q, num_kv, dtype=torch.bool, device=q.device).tril(diagonal=offset)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)  # [num_q, num_heads, v_dim]
