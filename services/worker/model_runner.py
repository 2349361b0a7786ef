"""ModelRunner: the worker's sequences, KV pages and one forward + sample per SchedulerOutput."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from libs.models.attention import AttentionFn
from libs.protocol.codec import pack_tokens, unpack_tokens
from libs.protocol.messages import ModelRunnerOutput, SamplingParams, SchedulerOutput
from services.worker.attention import KVPool, StepAttention
from services.worker.block_manager import BlockManager
from services.worker.sampler import Sampler

log = logging.getLogger(__name__)


class CausalLM(Protocol):
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(eq=False)
class SequenceState:
    token_ids: list[int]  # prompt + sampled; the last one's k/v is not in the pool yet
    sampling_params: SamplingParams
    scheduler_id: str  # who scheduled it; its state goes if that scheduler goes
    generator: torch.Generator | None = None
    num_computed_tokens: int = 0  # tokens whose k/v is in the pool


@dataclass
class StepBatch:
    """What one step feeds the model, in the flat layout of StepAttention."""

    seq_ids: list[str] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    logits_index: list[int] = field(default_factory=list)  # the token whose logits sample each seq
    prefill_spans: list[tuple[int, int]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self, model: CausalLM, layout: KVLayout, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> None:
        self.model = model
        self.block_manager = BlockManager(num_blocks, block_size)
        self.pool = KVPool(
            layout.num_layers, num_blocks * block_size, layout.num_kv_heads, layout.head_dim, dtype
        )
        self.sampler = Sampler()
        self.seqs: dict[str, SequenceState] = {}

    @property
    def num_running_seqs(self) -> int:
        return len(self.seqs)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        for seq_id in plan.finished_seq_ids:
            self.free(seq_id)
        for new in plan.new_seqs:
            gen = None
            if new.sampling_params.seed is not None:
                gen = torch.Generator().manual_seed(new.sampling_params.seed)
            self.seqs[new.seq_id] = SequenceState(
                unpack_tokens(new.prompt_token_ids), new.sampling_params, plan.scheduler_id, gen
            )
        batch, failed = self._build_batch([s.seq_id for s in plan.new_seqs], list(plan.decode_seq_ids))
        if failed:
            log.warning("KV cache full: failing %d sequences", len(failed))
        sampled = self._run(batch) if batch.seq_ids else []
        return ModelRunnerOutput(
            step_id=plan.step_id,
            seq_ids=tuple(batch.seq_ids),
            sampled_token_ids=pack_tokens(sampled),
            num_running_seqs=self.num_running_seqs,
            failed_seq_ids=tuple(failed),
        )

    def schedulers(self) -> set[str]:
        """Schedulers that own at least one sequence here."""
        return {s.scheduler_id for s in self.seqs.values()}

    def free_owned_by(self, scheduler_id: str) -> int:
        """Drop every sequence of ``scheduler_id``; returns how many."""
        owned = [seq_id for seq_id, s in self.seqs.items() if s.scheduler_id == scheduler_id]
        for seq_id in owned:
            self.free(seq_id)
        return len(owned)

    def reset(self) -> None:
        """Drop every sequence (after a failed step the scheduler fails them all)."""
        for seq_id in list(self.seqs):
            self.free(seq_id)

    def free(self, seq_id: str) -> None:
        self.seqs.pop(seq_id, None)
        self.block_manager.free(seq_id)

    def _build_batch(self, prefill_ids: list[str], decode_ids: list[str]) -> tuple[StepBatch, list[str]]:
        """Lay out the step's tokens; sequences whose pages cannot be allocated are failed instead."""
        batch, failed = StepBatch(), []
        for seq_id in prefill_ids + decode_ids:
            seq = self.seqs[seq_id]
            start, end = seq.num_computed_tokens, len(seq.token_ids)
            if not self.block_manager.can_allocate(seq_id, end):
                failed.append(seq_id)
                continue
            self.block_manager.allocate(seq_id, end)
            if start == 0:
                batch.prefill_spans.append((len(batch.input_ids), end))
            else:
                assert end - start == 1, "a running sequence decodes one token per step"
            batch.seq_ids.append(seq_id)
            batch.input_ids += seq.token_ids[start:end]
            batch.positions += range(start, end)
            batch.slots += (self.block_manager.slot(seq_id, p) for p in range(start, end))
            batch.logits_index.append(len(batch.input_ids) - 1)
        for seq_id in failed:
            self.free(seq_id)
        return batch, failed

    def _decode_gather(self, decode_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool slots of every decode sequence's tokens, padded to the longest, and its mask."""
        lengths = [len(self.seqs[s].token_ids) for s in decode_ids]
        max_len = max(lengths)
        bs = self.block_manager.block_size
        max_blocks = -(-max_len // bs)
        tables = torch.zeros(len(decode_ids), max_blocks, dtype=torch.long)
        for i, seq_id in enumerate(decode_ids):
            table = self.block_manager.block_tables[seq_id]
            tables[i, : len(table)] = torch.tensor(table[:max_blocks])
        pos = torch.arange(max_len)
        slots = tables[:, pos // bs] * bs + pos % bs  # [num_decode, max_len]
        mask = pos.unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
        return slots, mask[:, None, None, :]

    def _run(self, batch: StepBatch) -> list[int]:
        num_prefill_tokens = sum(n for _, n in batch.prefill_spans)
        decode_ids = batch.seq_ids[len(batch.prefill_spans) :]
        decode_slots = decode_mask = None
        if decode_ids:
            decode_slots, decode_mask = self._decode_gather(decode_ids)
        attention = StepAttention(
            pool=self.pool,
            slot_mapping=torch.tensor(batch.slots, dtype=torch.long),
            prefill_spans=tuple(batch.prefill_spans),
            num_prefill_tokens=num_prefill_tokens,
            decode_slots=decode_slots,
            decode_mask=decode_mask,
        )
        input_ids = torch.tensor(batch.input_ids, dtype=torch.long)
        positions = torch.tensor(batch.positions, dtype=torch.long)
        hidden = self.model(input_ids, positions, attention)
        logits = self.model.compute_logits(hidden[torch.tensor(batch.logits_index)])
        states = [self.seqs[s] for s in batch.seq_ids]
        sampled = self.sampler(logits, [s.sampling_params for s in states], [s.generator for s in states])
        for state, token_id in zip(states, sampled, strict=True):
            state.num_computed_tokens = len(state.token_ids)
            state.token_ids.append(token_id)
        return sampled

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()
        assert set(self.block_manager.block_tables) <= set(self.seqs)
