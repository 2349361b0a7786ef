"""ModelRunner: the worker's sequences and KV pages, and one forward + sample per SchedulerOutput.

The scheduler decides everything about KV placement: a plan names, for each sequence, the pages
to append to its block table and how many tokens to compute after those already computed. The
runner lays the step out flat (rows with several tokens first, then single-token rows, as the
attention backend wants), runs the model once, and samples for the rows whose computed tokens
reach the end of what they know: a prefill's last chunk, or a decode.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from libs.kernels.paged_attention import PagedAttentionMetadata, make_attention_backend
from libs.models.attention import AttentionFn
from libs.models.config import LlamaConfig
from libs.protocol.codec import pack_tokens, unpack_tokens
from libs.protocol.messages import Logprobs, ModelRunnerOutput, NewSequence, SchedulerOutput
from services.worker.grammar import Grammars, MaskJob, MaskResult, SequenceGrammar
from services.worker.kv_cache import KVCache, KVLayout, StepAttention
from services.worker.sampler import GrammarMask, Sampler
from services.worker.sequence_state import SequenceState

log = logging.getLogger(__name__)


class CausalLM(Protocol):
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_heads: int
    layout: KVLayout

    @classmethod
    def of(cls, config: LlamaConfig) -> ModelShape:
        layout = KVLayout(config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
        return cls(config.num_attention_heads, layout)


@dataclass(frozen=True, slots=True)
class _Row:
    state: SequenceState
    num_tokens: int  # computed in this step, from state.num_computed_tokens on


@dataclass(frozen=True, slots=True)
class _Sampled:
    rows: list[_Row]  # the rows that sampled, in layout order
    token_ids: list[int]
    logprobs: list[Logprobs | None]
    failed: dict[str, str]  # seq_id -> why its grammar cannot be used


class PlanError(ValueError):
    """A plan that contradicts what the worker holds (a scheduler bug, or a lost step)."""


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        shape: ModelShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        grammars: Grammars | None = None,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.kv_cache = KVCache(shape.layout, num_blocks, block_size, dtype, self.device)
        self.backend = make_attention_backend(
            self.device, shape.num_heads, shape.layout.num_kv_heads, shape.layout.head_dim, dtype
        )
        self.sampler = Sampler()
        self.seqs: dict[str, SequenceState] = {}
        self.grammars = grammars if grammars is not None else Grammars(None)
        self._masks: MaskJob | None = None  # made on the first constrained step

    @property
    def num_running_seqs(self) -> int:
        return len(self.seqs)

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        rows = [self._add(new) for new in plan.new_seqs]
        counts = unpack_tokens(plan.num_scheduled_tokens)
        if not len(counts) == len(plan.seq_ids) == len(plan.new_block_ids):
            raise PlanError("seq_ids, num_scheduled_tokens and new_block_ids differ in length")
        for seq_id, num_tokens, blocks in zip(plan.seq_ids, counts, plan.new_block_ids, strict=True):
            state = self.seqs.get(seq_id)
            if state is None:
                raise PlanError(f"sequence {seq_id!r} is not held here")
            new_blocks = unpack_tokens(blocks)
            self._check_blocks(seq_id, new_blocks)
            state.block_table += new_blocks
            rows.append(_Row(state, num_tokens))
        for row in rows:
            self._check_row(row)
        sampled = self._run(rows) if rows else _Sampled([], [], [], {})
        logprobs = sampled.logprobs
        return ModelRunnerOutput(
            step_id=plan.step_id,
            seq_ids=tuple(r.state.seq_id for r in sampled.rows),
            sampled_token_ids=pack_tokens(sampled.token_ids),
            num_running_seqs=self.num_running_seqs,
            logprobs=tuple(logprobs) if any(lp is not None for lp in logprobs) else (),
            failed_seq_ids=tuple(sampled.failed),
            failed_errors=tuple(sampled.failed.values()),
        )

    def _add(self, new: NewSequence) -> _Row:
        prompt = unpack_tokens(new.prompt_token_ids)
        block_table = unpack_tokens(new.block_ids)
        self._check_blocks(new.seq_id, block_table)
        state = SequenceState(
            seq_id=new.seq_id,
            token_ids=prompt + unpack_tokens(new.output_token_ids),
            num_prompt_tokens=len(prompt),
            sampling_params=new.sampling_params,
            stop_token_ids=frozenset(new.stop_token_ids),
            block_table=block_table,
            num_computed_tokens=new.num_computed_tokens,
        )
        constraint = new.sampling_params.structured_output
        if constraint is not None:
            # Compiling starts now, on a helper thread, and overlaps this step's prefill.
            compiled = self.grammars.submit(constraint)
            state.grammar = SequenceGrammar(constraint, compiled, new.stop_token_ids, self.grammars.alphabet)
            for token_id in state.output_token_ids:  # a resumed sequence replays its outputs
                state.grammar.accept(token_id)
        self.seqs[new.seq_id] = state
        return _Row(state, new.num_scheduled_tokens)

    def _check_row(self, row: _Row) -> None:
        state, end = row.state, row.state.num_computed_tokens + row.num_tokens
        if row.num_tokens <= 0 or end > state.num_tokens:
            raise PlanError(
                f"{state.seq_id}: {row.num_tokens} tokens after {state.num_computed_tokens} "
                f"of {state.num_tokens}"
            )
        if len(state.block_table) * self.block_size < end:
            raise PlanError(f"{state.seq_id}: block table too short for {end} tokens")

    def _check_blocks(self, seq_id: str, block_ids: list[int]) -> None:
        """Only the ids a plan adds: those already in a table were checked when they came."""
        if max(block_ids, default=0) >= self.kv_cache.num_blocks:
            raise PlanError(f"{seq_id}: block id beyond the pool")

    def _run(self, rows: list[_Row]) -> _Sampled:
        # Multi-token rows (prefill chunks) first, then single-token rows (decodes): the layout
        # the attention backends batch on. Sorting is stable, so plan order is kept within each.
        rows = sorted(rows, key=lambda r: r.num_tokens == 1)
        input_ids: list[int] = []
        positions: list[int] = []
        logits_index: list[int] = []
        sampled_rows: list[_Row] = []
        for row in rows:
            start = row.state.num_computed_tokens
            end = start + row.num_tokens
            input_ids += row.state.token_ids[start:end]
            positions += range(start, end)
            if end == row.state.num_tokens:
                logits_index.append(len(input_ids) - 1)
                sampled_rows.append(row)
        meta = PagedAttentionMetadata.build(
            query_lens=[r.num_tokens for r in rows],
            context_lens=[r.state.num_computed_tokens for r in rows],
            block_tables=[r.state.block_table for r in rows],
            block_size=self.block_size,
            device=self.device,
        )
        self.backend.plan(meta)
        masks = self._start_masks(sampled_rows)  # filled while the forward runs
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            StepAttention(self.backend, self.kv_cache),
        )
        for row in rows:
            row.state.num_computed_tokens += row.num_tokens
        if not sampled_rows:
            return _Sampled([], [], [], {})
        index = torch.tensor(logits_index, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        mask = masks.result() if masks is not None else None
        grammar_mask = None
        if mask is not None and mask.bias is not None:
            grammar_mask = GrammarMask(mask.rows, mask.bias)
        out = self.sampler(logits, [r.state for r in sampled_rows], grammar_mask)
        token_ids = out.token_ids
        failed: dict[str, str] = {}
        for j, why in mask.failed.items() if mask is not None else ():
            state = sampled_rows[j].state
            failed[state.seq_id] = why
            state.grammar = None
            # A stop token keeps the worker in step with plans already in flight for it.
            token_ids[j] = min(state.stop_token_ids, default=token_ids[j])
        for row, token_id in zip(sampled_rows, token_ids, strict=True):
            row.state.token_ids.append(token_id)
            if row.state.grammar is not None:
                row.state.grammar.accept(token_id)
        return _Sampled(sampled_rows, token_ids, list(out.logprobs), failed)

    def _start_masks(self, sampled_rows: list[_Row]) -> Future[MaskResult] | None:
        constrained = [
            (j, row.state.grammar, row.state.sampling_params.max_tokens - row.state.num_output_tokens)
            for j, row in enumerate(sampled_rows)
            if row.state.grammar is not None and row.state.grammar.active
        ]
        if not constrained:
            return None
        if self._masks is None:
            self._masks = MaskJob(self.grammars.vocab_size)
        return self._masks.start(constrained)

    def reset(self) -> None:
        """Drop every sequence: after a failed step (the scheduler fails them all), or when the
        owner is gone (every sequence here is the owner's)."""
        self.seqs.clear()

    def check_integrity(self) -> None:
        for state in self.seqs.values():
            assert state.num_computed_tokens <= state.num_tokens
            assert len(state.block_table) * self.block_size >= state.num_computed_tokens
            assert all(0 <= b < self.kv_cache.num_blocks for b in state.block_table)
