"""MLA: the absorbed form equals the expanded one, and the paged backend (expanded prefill rows,
absorbed decode rows over a shuffled latent cache) equals the expanded form per row."""

from __future__ import annotations

import torch

from libs.kernels.mla_attention import (
    MLAWeights,
    PagedMLABackend,
    mla_absorbed_attention,
    mla_expanded_attention,
)
from libs.kernels.paged_attention import PagedAttentionMetadata
from tests.unit.kernels.test_paged_attention import MIXED, make_layout

HEADS, NOPE, ROPE, V, RANK = 4, 16, 8, 12, 20
SCALE = 0.135


def weights(g: torch.Generator) -> MLAWeights:
    return MLAWeights(
        torch.randn(HEADS, NOPE, RANK, generator=g), torch.randn(HEADS, V, RANK, generator=g), SCALE
    )


def test_absorbed_equals_expanded() -> None:
    g = torch.Generator().manual_seed(0)
    w = weights(g)
    num_q, num_kv = 5, 13  # a chunk after 8 cached tokens
    q_nope, q_pe = torch.randn(num_q, HEADS, NOPE, generator=g), torch.randn(num_q, HEADS, ROPE, generator=g)
    latent, k_pe = torch.randn(num_kv, RANK, generator=g), torch.randn(num_kv, ROPE, generator=g)
    expanded = mla_expanded_attention(q_nope, q_pe, latent, k_pe, w)
    assert expanded.shape == (num_q, HEADS, V)
    torch.testing.assert_close(
        mla_absorbed_attention(q_nope, q_pe, latent, k_pe, w), expanded, atol=1e-5, rtol=1e-5
    )


def test_paged_backend_matches_the_expanded_form_per_row() -> None:
    g = torch.Generator().manual_seed(1)
    block_size = 4
    w = weights(g)
    tables, num_blocks = make_layout(MIXED, block_size, g)
    meta = PagedAttentionMetadata.build([q for q, _ in MIXED], [c for _, c in MIXED], tables, block_size)
    # Every slot starts random, so a read of a wrong slot changes the output.
    cache = torch.randn(num_blocks, block_size, RANK + ROPE, generator=g)
    before = cache.clone()
    n = meta.num_tokens
    q_nope, q_pe = torch.randn(n, HEADS, NOPE, generator=g), torch.randn(n, HEADS, ROPE, generator=g)
    latent, k_pe = torch.randn(n, RANK, generator=g), torch.randn(n, ROPE, generator=g)
    backend = PagedMLABackend()
    backend.plan(meta)
    out = backend.forward(q_nope, q_pe, latent, k_pe, w, cache)
    start = 0
    for (query_len, context_len), table in zip(MIXED, tables, strict=True):
        end = start + query_len
        slots = [table[p // block_size] * block_size + p % block_size for p in range(context_len + query_len)]
        entries = before.view(-1, RANK + ROPE)[slots].clone()
        entries[context_len:] = torch.cat([latent[start:end], k_pe[start:end]], dim=-1)
        # the new entries landed in their slots
        torch.testing.assert_close(cache.view(-1, RANK + ROPE)[slots], entries)
        expected = mla_expanded_attention(
            q_nope[start:end], q_pe[start:end], entries[:, :RANK], entries[:, RANK:], w
        )
        torch.testing.assert_close(out[start:end], expected, atol=1e-5, rtol=1e-5)
        start = end
