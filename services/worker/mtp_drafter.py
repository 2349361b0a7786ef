"""MTPDrafter: drafts with the model's own multi-token-prediction module (DeepSeek V3's MTP).

MTP module 0 at position i reads the main model's final-normed hidden h_i and the token after
it, t_{i+1}, attends over its own latent cache (one MLA layer, the drafter's pages: the main
KV spec is unchanged), and its logits predict t_{i+2}. After every forward the drafter runs
the module over each row's positions that stand: a prefill chunk's (its next tokens are the
prompt's, the last one the sampled token), a decode's, a verification row's up to its last
accepted draft. That keeps the module's cache full, and at the last position of each row that
sampled it yields the draft: the greedy token after the one just sampled, with its
probability (the scheduler buckets it to predict acceptance).

The drafter's pages share the main cache's block ids, so what the scheduler allocates covers
both. KV that reaches a sequence another way (a prefix-cache hit, a G2 / G3 load, a P/D
handoff) brings no drafter KV with it: those positions hold whatever the block held before.
Drafts then get worse, never the output (the worker verifies every draft against its own
samples), and the positions are rewritten when recomputed. One module only: V3, R1 and V3.2
ship one (``num_nextn_predict_layers`` 1), so a draft is one token.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from libs.kernels.mla_attention import MLAWeights, PagedMLABackend
from libs.kernels.paged_attention import PagedAttentionMetadata
from libs.kvstore.kv_spec import KVSpec
from libs.models.deepseek_v3 import DeepseekV3ForCausalLM
from services.worker.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class MTPRow:
    """One row of the step just run, as the drafter sees it."""

    token_ids: list[int]  # the sequence's tokens after the step (the sampled one included)
    start: int  # its first position computed in the step
    num_valid: int  # positions from ``start`` whose KV stands (rejected drafts excluded), >= 1
    offset: int  # where ``start``'s hidden is in the step's flat batch
    block_table: list[int]
    samples: bool  # it sampled: its last valid position drafts


@dataclass(frozen=True, slots=True)
class _LayerOffset:
    """The MLAAttentionFn of the drafter: module k's block is layer L + k, its pages are ours."""

    backend: PagedMLABackend
    kv_cache: KVCache
    first_layer: int

    def __call__(
        self, layer_idx: int, q_nope: Tensor, q_pe: Tensor, latent: Tensor, k_pe: Tensor, weights: MLAWeights
    ) -> Tensor:
        page = self.kv_cache.planes[0][layer_idx - self.first_layer]
        return self.backend.forward(
            q_nope, q_pe, latent, k_pe, weights, page.view(*page.shape[:2], page.shape[-1])
        )


class MTPDrafter:
    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        config = model.config
        if config.num_nextn_predict_layers < 1 or len(model.mtp) < 1:
            raise ValueError("--speculative-method mtp: this model has no MTP module")
        self.model = model
        self.device = device
        spec = KVSpec.mla(1, config.kv_lora_rank, config.qk_rope_head_dim)
        self.kv_cache = KVCache(spec, num_blocks, block_size, dtype, device)
        self.backend = PagedMLABackend()
        self.first_layer = config.num_hidden_layers

    def draft(self, rows: list[MTPRow], hidden: Tensor) -> list[tuple[int, float]]:
        """Run the module over ``rows`` (``hidden``: the step's main hidden, [num_tokens, hidden]),
        writing its cache; returns (token, probability) for each row that samples, in order."""
        # The backend batches multi-token rows first, then single-token rows (stable: order kept).
        order = sorted(range(len(rows)), key=lambda i: rows[i].num_valid == 1)
        laid = [rows[i] for i in order]
        next_ids: list[int] = []
        positions: list[int] = []
        index: list[int] = []
        for row in laid:
            next_ids += row.token_ids[row.start + 1 : row.start + row.num_valid + 1]
            positions += range(row.start, row.start + row.num_valid)
            index += range(row.offset, row.offset + row.num_valid)
        meta = PagedAttentionMetadata.build(
            query_lens=[r.num_valid for r in laid],
            context_lens=[r.start for r in laid],
            block_tables=[r.block_table for r in laid],
            block_size=self.kv_cache.block_size,
            device=self.device,
        )
        self.backend.plan(meta)
        out = self.model.forward_mtp(
            0,
            torch.tensor(next_ids, dtype=torch.long, device=self.device),
            hidden.index_select(0, torch.tensor(index, dtype=torch.long, device=self.device)),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            _LayerOffset(self.backend, self.kv_cache, self.first_layer),
        )
        ends = list(itertools.accumulate(r.num_valid for r in laid))
        sampling = [j for j, row in enumerate(laid) if row.samples]
        if not sampling:
            return []
        last = torch.tensor([ends[j] - 1 for j in sampling], dtype=torch.long, device=self.device)
        probs = torch.softmax(self.model.compute_logits(out.index_select(0, last)).float(), dim=-1)
        best, token_ids = probs.max(dim=-1)
        pairs = zip(token_ids.tolist(), best.tolist(), strict=True)
        drafted = dict(zip((order[j] for j in sampling), pairs, strict=True))
        return [drafted[i] for i in range(len(rows)) if rows[i].samples]
