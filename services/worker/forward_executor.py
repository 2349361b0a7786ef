"""ForwardExecutor: the model over one step's flat batch and the KV pages, and nothing else.

The step driver (ModelRunner) parses plans, keeps sequences, moves KV between tiers, samples and
applies grammars; it hands the executor a ForwardBatch of token ids, positions and block tables
and gets the logits of the rows that sample. The executor owns the pages (laid out by the model's
KVSpec), the attention backend for that kind of KV, and the model. What runs a forward faster or
on more devices (compiled graphs, tensor parallel ranks) replaces this class, not the driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from libs.kernels import cpu_ext
from libs.kernels.decoder_blocks import BlockWeights, PagedKernelStep, decoder_blocks
from libs.kernels.linear import batch_invariant_products
from libs.kernels.mla_attention import PagedMLABackend
from libs.kernels.paged_attention import AttentionBackend, PagedAttentionMetadata, make_attention_backend
from libs.kernels.paged_attention_invariant import BatchInvariantAttentionBackend
from libs.kernels.paged_attention_torch import TorchAttentionBackend
from libs.kvstore.kv_spec import MLA, KVSpec
from libs.modelfiles.deepseek_config import DeepseekV3Config
from libs.modelfiles.llama_config import LlamaConfig
from libs.models.attention import AttentionFn, MLAAttentionFn
from libs.models.llama import LlamaForCausalLM
from libs.models.quant import Int8Linear, int8_block_weights
from services.worker.kv_cache import KVBlocks, KVCache, StepAttention, StepMLAAttention


class CausalLM(Protocol):
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn | MLAAttentionFn,
        **image_inputs: Any,  # image_rows, image_embeds: a vision model's (LlamaForCausalLM)
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class Executor(Protocol):
    """What the step driver runs forwards on: a ForwardExecutor, or a tensor-parallel worker's
    rank 0 (ParallelExecutor)."""

    device: torch.device

    @property
    def kv_cache(self) -> KVBlocks: ...

    @property
    def last_hidden(self) -> torch.Tensor | None: ...

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None: ...


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
    # flat positions whose token embeddings are replaced by image embeddings [len, hidden]
    image_rows: list[int] = field(default_factory=list)
    image_embeds: torch.Tensor | None = None


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
        fuse_blocks: bool = True,
        one_thread_max_tokens: int = 0,
    ) -> None:
        """``batch_invariant``: attention whose outputs do not depend on the batch (--deterministic).
        ``fuse_blocks``: run int8 Llama blocks as one op on steps the paged kernel attends whole
        (``_forward_blocks``); off, every step runs op by op (the fused op's reference).
        ``one_thread_max_tokens``: a step of at most this many tokens runs on one thread, larger
        ones on the threads torch has now (0: every step on those). The CPU kernels' threads claim
        small chunks of work (libs/kernels/csrc/pool.h), so on a CPU shared with the scheduler,
        the gateway and NATS a preempted thread no longer holds a step; before, when a forward
        waited at each of its parallel regions for such a thread, one thread paid at small steps."""
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
        self.blocks: BlockWeights | None = None
        torch_backend = isinstance(self.backend, TorchAttentionBackend)
        if fuse_blocks and torch_backend and isinstance(model, LlamaForCausalLM):
            self.blocks = int8_block_weights(model)
        self.num_fused_steps = 0  # steps that ran as one op (tests assert the fused path ran)
        # Not with batch invariance: a product's blocking, and so its rounding, changes with the
        # number of threads, and a row alone would run on one where its batch ran on several.
        self.one_thread_max_tokens = 0 if batch_invariant else one_thread_max_tokens
        self.batch_invariant = batch_invariant  # bf16 products too (libs/kernels/linear.py)
        self.num_threads = torch.get_num_threads()  # for larger steps

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
        # The fused blocks embed tokens themselves: a step with image rows runs op by op.
        fused_step = None if batch.image_rows else self._fused_step(len(batch.input_ids))
        in_kernels = fused_step is not None or self._invariant_kernels(batch)
        self._set_threads(len(batch.input_ids), kernels=in_kernels)
        input_ids = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
        with batch_invariant_products(self.batch_invariant):
            hidden = None if fused_step is None else self._forward_blocks(input_ids, positions, fused_step)
            if hidden is None and batch.image_embeds is not None:
                image_rows = torch.tensor(batch.image_rows, dtype=torch.long, device=self.device)
                hidden = self.model(
                    input_ids, positions, attention, image_rows=image_rows, image_embeds=batch.image_embeds
                )
            elif hidden is None:
                hidden = self.model(input_ids, positions, attention)
            self.last_hidden = hidden  # [num_tokens, hidden_size]: what a drafter reads after the step
            if not batch.logits_index:
                return None
            index = torch.tensor(batch.logits_index, dtype=torch.long, device=self.device)
            return self.model.compute_logits(hidden.index_select(0, index))

    def _set_threads(self, num_tokens: int, kernels: bool) -> None:
        """torch's threads and the CPU kernels' (libs/kernels/csrc/pool.h) for a step.
        torch.set_num_threads sets this thread's OpenMP team size (the worker's forwards all run on
        one thread). A step whose products and attention all run in the extension (``kernels``)
        runs its torch ops (and the sampling after it) on one thread, so no OpenMP team spins
        beside the kernels' threads waiting for work that will not come."""
        if self.device.type != "cpu":
            return
        small = 0 < num_tokens <= self.one_thread_max_tokens
        torch.set_num_threads(1 if small or kernels else self.num_threads)
        cpu_ext.set_num_threads(1 if small else self.num_threads)

    def _invariant_kernels(self, batch: ForwardBatch) -> bool:
        """Whether a --deterministic step of decode size runs its products (bf16_linear) and its
        attention (every token to the paged kernel) in the extension."""
        backend = self.backend
        return (
            self.batch_invariant
            and isinstance(backend, BatchInvariantAttentionBackend)
            and backend.use_kernel
            and len(batch.input_ids) < Int8Linear.fp32_dense_min_tokens  # prefills keep torch's threads
        )

    def _fused_step(self, num_tokens: int) -> PagedKernelStep | None:
        """The paged kernel's view of this step, where the fused decoder blocks apply: int8 Llama
        blocks with fp32 activations, a step the paged kernel attends whole, and fewer tokens
        than the int8 layers' dense threshold (past it they dequantize, and so would differ)."""
        if self.blocks is None or num_tokens >= Int8Linear.fp32_dense_min_tokens or cpu_ext.ops() is None:
            return None
        assert isinstance(self.backend, TorchAttentionBackend)
        return self.backend.kernel_step()

    def _forward_blocks(
        self, input_ids: torch.Tensor, positions: torch.Tensor, step: PagedKernelStep
    ) -> torch.Tensor | None:
        """The final-normed hidden from the fused decoder blocks (None where they decline)."""
        assert self.blocks is not None and isinstance(self.model, LlamaForCausalLM)
        assert isinstance(self.backend, TorchAttentionBackend)
        keys, values = self.kv_cache.planes
        hidden = decoder_blocks(
            self.model.embed_tokens(input_ids),
            positions,
            self.blocks,
            self.model.cos_sin_cache,
            keys,
            values,
            step,
            self.backend.scale,
        )
        self.num_fused_steps += hidden is not None
        return hidden
