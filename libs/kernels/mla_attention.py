"""Multi-head latent attention (DeepSeek MLA) over a paged latent cache: the two forms and a backend.

MLA caches one vector per token and layer: the normed KV latent c [kv_lora_rank] followed by the
roped shared key k_pe [rope_dim] (vLLM's and FlashMLA's entry: one [.., kv_lora_rank + rope_dim]
row). Per head h, with kv_b_proj's rows split into W_UK[h] [nope_dim, kv_lora_rank] and W_UV[h]
[v_dim, kv_lora_rank]:

- expanded (MHA) form: k[h] = [W_UK[h] c ; k_pe], v[h] = W_UV[h] c, attention with
  q[h] = [q_nope[h] ; q_pe[h]]. Cheapest when many queries share few keys' expansion: prefill.
- absorbed (MQA) form: q_lat[h] = W_UK[h]^T q_nope[h]; one KV head [c ; k_pe] with V = c; the
  output latent o[h] goes through W_UV[h]. No per-key expansion: decode.

Both give the same q.k and the same output; the scale is the model's (YaRN's mscale included),
never 1/sqrt of the cache width. Cache pages per layer: [num_blocks, block_size, kv_lora_rank +
rope_dim], slots as in paged_attention (block_id * block_size + offset).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from libs.kernels.attention import causal_attention
from libs.kernels.paged_attention import PagedAttentionMetadata


@dataclass(frozen=True, slots=True)
class MLAWeights:
    """One layer's kv_b_proj split per head, and the softmax scale.

    w_uk: [num_heads, nope_dim, kv_lora_rank]; w_uv: [num_heads, v_dim, kv_lora_rank].
    """

    w_uk: Tensor
    w_uv: Tensor
    scale: float

    @property
    def kv_lora_rank(self) -> int:
        return int(self.w_uk.shape[-1])


def mla_expanded_attention(
    q_nope: Tensor, q_pe: Tensor, latent: Tensor, k_pe: Tensor, weights: MLAWeights
) -> Tensor:
    """One sequence, causal, in the expanded form; the last query aligns with the last key.

    q_nope: [num_q, H, nope_dim]; q_pe: [num_q, H, rope_dim]; latent: [num_kv, kv_lora_rank];
    k_pe: [num_kv, rope_dim] with num_kv >= num_q. Returns [num_q, H, v_dim].
    """
    num_heads = q_nope.shape[1]
    k_nope = torch.einsum("sr,hdr->shd", latent, weights.w_uk)  # [num_kv, H, nope_dim]
    v = torch.einsum("sr,hdr->shd", latent, weights.w_uv)  # [num_kv, H, v_dim]
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    return causal_attention(q, k, v, weights.scale)


def absorb_query(q_nope: Tensor, q_pe: Tensor, weights: MLAWeights) -> Tensor:
    """[W_UK^T q_nope ; q_pe] per head: [num_q, H, kv_lora_rank + rope_dim]."""
    q_latent = torch.einsum("thd,hdr->thr", q_nope, weights.w_uk)
    return torch.cat([q_latent, q_pe], dim=-1)


def mla_absorbed_attention(
    q_nope: Tensor, q_pe: Tensor, latent: Tensor, k_pe: Tensor, weights: MLAWeights
) -> Tensor:
    """mla_expanded_attention's result in the absorbed form (the same shapes in and out)."""
    rank = weights.kv_lora_rank
    entries = torch.cat([latent, k_pe], dim=-1)[:, None, :]  # [num_kv, 1, rank + rope_dim]
    q = absorb_query(q_nope, q_pe, weights)  # [num_q, H, rank + rope_dim]
    out_latent = causal_attention(q, entries, entries[..., :rank], weights.scale)  # [num_q, H, rank]
    return torch.einsum("thr,hdr->thd", out_latent, weights.w_uv)


class PagedMLABackend:
    """MLA for one step's flat batch over paged latent pages: plan once, forward once per layer.

    Prefill rows (query_len > 1) run the expanded form over their gathered context and new
    entries; decode rows run the absorbed form together, one padded SDPA with the heads folded
    into the query dim (decode has no causal structure), padded keys masked out. Plain torch:
    the CPU path, and fp32 anywhere.
    """

    def __init__(self) -> None:
        self._meta: PagedAttentionMetadata | None = None
        self._rows: list[tuple[int, int, Tensor]] = []  # (start, end, slots of the row's keys)
        self._decode_slots: Tensor | None = None  # [num_decodes, padded_len]
        self._decode_mask: Tensor | None = None  # [num_decodes, 1, 1, padded_len] bool

    def plan(self, meta: PagedAttentionMetadata) -> None:
        device = meta.block_tables.device
        starts, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        tables = meta.block_tables.long()
        offsets = torch.arange(meta.block_size, device=device)
        self._rows = []
        for row in range(meta.num_prefills):
            positions = torch.arange(seq_lens[row], device=device)
            slots = tables[row, positions // meta.block_size] * meta.block_size + positions % meta.block_size
            self._rows.append((starts[row], starts[row + 1], slots))
        self._decode_slots = self._decode_mask = None
        if meta.num_prefills < meta.num_seqs:
            decode_tables = tables[meta.num_prefills :]  # [num_decodes, max_blocks]
            padded = decode_tables[:, :, None] * meta.block_size + offsets  # [num_decodes, max_blocks, block]
            self._decode_slots = padded.flatten(1)
            lens = meta.seq_lens[meta.num_prefills :].to(device=device, dtype=torch.long)
            valid = torch.arange(self._decode_slots.shape[1], device=device)[None, :] < lens[:, None]
            self._decode_mask = valid[:, None, None, :]
        self._meta = meta

    def forward(
        self,
        q_nope: Tensor,
        q_pe: Tensor,
        latent: Tensor,
        k_pe: Tensor,
        weights: MLAWeights,
        kv_cache: Tensor,
    ) -> Tensor:
        """Write the step's entries at the planned slots, then attend.

        q_nope: [num_tokens, H, nope_dim]; q_pe: [num_tokens, H, rope_dim]; latent: [num_tokens,
        kv_lora_rank]; k_pe: [num_tokens, rope_dim] (roped); kv_cache: [num_blocks, block_size,
        kv_lora_rank + rope_dim], written in place. Returns [num_tokens, H, v_dim].
        """
        meta = self._meta
        if meta is None:
            raise RuntimeError("forward() before plan()")
        rank = weights.kv_lora_rank
        entries = kv_cache.view(-1, kv_cache.shape[-1])  # [num_slots, rank + rope_dim]
        entries.index_copy_(0, meta.slot_mapping, torch.cat([latent, k_pe], dim=-1).to(kv_cache.dtype))
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], weights.w_uv.shape[1])
        for start, end, slots in self._rows:
            row = entries.index_select(0, slots)  # [seq_len, rank + rope_dim]
            out[start:end] = mla_expanded_attention(
                q_nope[start:end], q_pe[start:end], row[:, :rank], row[:, rank:], weights
            )
        if self._decode_slots is not None:
            start = meta.num_prefill_tokens
            q = absorb_query(q_nope[start:], q_pe[start:], weights)[:, None]  # [B, 1, H, rank + rope]
            keys = entries[self._decode_slots][:, None]  # [B, 1, padded_len, rank + rope_dim]
            out_latent = torch.nn.functional.scaled_dot_product_attention(
                q, keys, keys[..., :rank], attn_mask=self._decode_mask, scale=weights.scale
            )  # [B, 1, H, rank]
            out[start:] = torch.einsum("thr,hdr->thd", out_latent[:, 0], weights.w_uv)
        return out
