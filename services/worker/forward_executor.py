"""ForwardExecutor: the model over one step's flat batch and the KV pages, and nothing else.

The step driver (ModelRunner) parses plans, keeps sequences, moves KV between tiers, samples and
applies grammars; it hands the executor a ForwardBatch of token ids, positions and block tables
and gets the logits of the rows that sample. The executor owns the pages (laid out by the model's
KVSpec), the attention backend for that kind of KV, and the model. What runs a forward faster or
on more devices (compiled graphs, tensor parallel ranks) replaces this class, not the driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from libs.kernels.mla_attention import PagedMLABackend
from libs.kernels.paged_attention import AttentionBackend, PagedAttentionMetadata, make_attention_backend
from libs.kvstore.kv_spec import MLA, KVSpec
from libs.modelfiles.deepseek_config import DeepseekV3Config
from libs.modelfiles.llama_config import LlamaConfig
from libs.models.attention import AttentionFn, MLAAttentionFn
from services.worker.kv_cache import KVCache, StepAttention, StepMLAAttention


class CausalLM(Protocol):
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn | MLAAttentionFn
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_heads: int
    kv_spec: KVSpec
    vocab_size: int  # rows of the embedding table: a token id at or past it is refused
    max_num_tokens: int  # positions the model has (its RoPE table): a longer sequence is refused

    @classmethod
    def of(cls, config: LlamaConfig | DeepseekV3Config) -> ModelShape:
        return cls(
            config.num_attention_heads, config.kv_spec(), config.vocab_size, config.max_position_embeddings
        )


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """One step's rows, multi-token rows (prefill chunks) first, then single-token rows (decodes)."""

    input_ids: list[int]  # every row's tokens to compute, concatenated
    positions: list[int]
    query_lens: list[int]  # per row
    context_lens: list[int]  # per row: tokens already in its KV pages
    block_tables: list[list[int]]
    logits_index: list[int]  # the flat positions whose logits are wanted (rows that sample)


class ForwardExecutor:
    def __init__(
        self,
        model: CausalLM,
        shape: ModelShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        batch_invariant: bool = False,
    ) -> None:
        """``batch_invariant``: attention whose outputs do not depend on the batch (--deterministic)."""
        self.model = model
        self.shape = shape
        self.device = torch.device(device)
        self.kv_cache = KVCache(shape.kv_spec, num_blocks, block_size, dtype, self.device)
        spec = shape.kv_spec
        self.backend: AttentionBackend | PagedMLABackend = (
            PagedMLABackend()
            if spec.kind == MLA
            else make_attention_backend(
                self.device, shape.num_heads, spec.num_kv_heads, spec.head_dim, dtype, batch_invariant
            )
        )
        self.last_hidden: torch.Tensor | None = None

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Run the batch, writing its KV: the logits at ``logits_index``, [n, vocab] float32, or
        None when it is empty."""
        meta = PagedAttentionMetadata.build(
            query_lens=batch.query_lens,
            context_lens=batch.context_lens,
            block_tables=batch.block_tables,
            block_size=self.kv_cache.block_size,
            device=self.device,
        )
        self.backend.plan(meta)
        attention: AttentionFn | MLAAttentionFn
        if isinstance(self.backend, PagedMLABackend):
            attention = StepMLAAttention(self.backend, self.kv_cache)
        else:
            attention = StepAttention(self.backend, self.kv_cache)
        hidden = self.model(
            torch.tensor(batch.input_ids, dtype=torch.long, device=self.device),
            torch.tensor(batch.positions, dtype=torch.long, device=self.device),
            attention,
        )
        self.last_hidden = hidden  # [num_tokens, hidden_size]: what a drafter reads after the step
        if not batch.logits_index:
            return None
        index = torch.tensor(batch.logits_index, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, index))
