"""ModelRunner: the worker's sequences and KV pages, and one forward + sample per SchedulerOutput.

The scheduler decides everything about KV placement: a plan names, for each sequence, the pages
to append to its block table and how many tokens to compute after those already computed. The
runner lays the step out flat (rows with several tokens first, then single-token rows, as the
attention backend wants), runs the model once, and samples for the rows whose computed tokens
reach the end of what they know: a prefill's last chunk, or a decode.

With KV tiers (``kv_tiers``), a plan's ``kv_saves`` are copied out first, before anything in the
step can overwrite a freed page, then new sequences' ``kv_load`` blocks are filled from G2 / G3.
A block that cannot be filled is recomputed in this same forward with every block after it: its
row starts earlier and computes more tokens, and ends where the plan said.
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
from libs.protocol.kv_messages import HASH_NUM_BYTES, split_hashes
from libs.protocol.messages import Logprobs, ModelRunnerOutput, NewSequence, SchedulerOutput
from services.worker.grammar import Grammars, MaskJob, MaskResult, SequenceGrammar
from services.worker.kv_cache import KVCache, KVLayout, StepAttention
from services.worker.kv_tiers import KVTiers, LoadResult
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
        kv_tiers: KVTiers | None = None,
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
        self.kv_tiers = kv_tiers  # None: no G2 / G3; a plan's loads are all recomputed

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
        self._save(plan)
        rows: list[_Row] = []
        loads: dict[str, LoadResult] = {}
        for new in plan.new_seqs:
            row = self._add(new)
            if new.kv_load is not None:
                row, loads[new.seq_id] = self._load(row, new.kv_load.first_block, new.kv_load.block_hashes)
            rows.append(row)
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
            num_loaded_host_blocks=sum(r.num_host_blocks for r in loads.values()),
            num_loaded_store_blocks=sum(r.num_store_blocks for r in loads.values()),
            num_failed_load_blocks=sum(r.num_failed_blocks for r in loads.values()),
            failed_load_seq_ids=tuple(seq_id for seq_id, r in loads.items() if r.num_failed_blocks),
            failed_load_num_blocks=tuple(r.num_failed_blocks for r in loads.values() if r.num_failed_blocks),
        )

    def prefetch(self, plan: SchedulerOutput) -> None:
        """Start reading the plan's G3 loads now, before its turn (any thread; cheap)."""
        if self.kv_tiers is not None:
            self.kv_tiers.prefetch(plan)

    def _save(self, plan: SchedulerOutput) -> None:
        for save in plan.kv_saves:
            block_ids = unpack_tokens(save.block_ids)
            self._check_blocks("kv_saves", block_ids)
            if len(save.block_hashes) != HASH_NUM_BYTES * len(block_ids):
                raise PlanError(f"kv_saves: {len(block_ids)} blocks, {len(save.block_hashes)} hash bytes")
            if self.kv_tiers is not None:
                self.kv_tiers.save(self.kv_cache, save)

    def _load(self, row: _Row, first_block: int, hashes: bytes) -> tuple[_Row, LoadResult]:
        """Fill the row's loaded blocks; if only some load, the row starts at the first that did not."""
        state = row.state
        try:
            block_hashes = split_hashes(hashes)
        except ValueError as e:
            raise PlanError(f"{state.seq_id}: kv_load: {e}") from None
        end = first_block + len(block_hashes)
        if first_block < 0 or end * self.block_size > min(
            state.num_computed_tokens, len(state.block_table) * self.block_size
        ):
            raise PlanError(f"{state.seq_id}: kv_load of blocks {first_block}..{end} beyond its computed KV")
        block_ids = state.block_table[first_block:end]
        if self.kv_tiers is not None:
            loaded = self.kv_tiers.load(self.kv_cache, block_ids, block_hashes)
        else:
            loaded = LoadResult(0, 0, len(block_hashes))
        if not loaded.num_failed_blocks:
            return row, loaded
        restart = (first_block + loaded.num_loaded_blocks) * self.block_size
        num_recomputed = state.num_computed_tokens - restart
        state.num_computed_tokens = restart
        return _Row(state, row.num_tokens + num_recomputed), loaded

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
