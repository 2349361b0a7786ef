"""The attention contract between a model and whoever owns the KV cache, plus a cacheless reference."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from libs.kernels.attention import causal_attention
from libs.kernels.mla_attention import MLAWeights, mla_expanded_attention


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


class MLAAttentionFn(Protocol):
    """Multi-head latent attention for one layer over a flat varlen batch of tokens.

    q_nope: [num_tokens, num_heads, nope_dim]; q_pe: [num_tokens, num_heads, rope_dim] (roped);
    latent: [num_tokens, kv_lora_rank] (normed); k_pe: [num_tokens, rope_dim] (roped, one head
    shared by all); weights: the layer's kv_b_proj split per head and the softmax scale. Returns
    [num_tokens, num_heads, v_dim]. The implementation owns the latent cache (it stores
    [latent ; k_pe] per token) and picks the expanded or absorbed form per row.
    """

    def __call__(
        self, layer_idx: int, q_nope: Tensor, q_pe: Tensor, latent: Tensor, k_pe: Tensor, weights: MLAWeights
    ) -> Tensor: ...


class SingleSequenceMLAAttention:
    """MLAAttentionFn for ONE sequence given whole, with no cache: the expanded form, causal."""

    def __call__(
        self, layer_idx: int, q_nope: Tensor, q_pe: Tensor, latent: Tensor, k_pe: Tensor, weights: MLAWeights
    ) -> Tensor:
        del layer_idx  # no per-layer state
        return mla_expanded_attention(q_nope, q_pe, latent, k_pe, weights)
