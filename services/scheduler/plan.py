"""One step's plan as the scheduler core builds it, and its wire form: a SchedulerOutput diff
(a sequence the worker does not hold travels whole, one it holds by id with its new blocks)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from libs.protocol.codec import pack_tokens
from libs.protocol.kv_messages import KVLoad, KVSave, PartialSave
from libs.protocol.messages import NewSequence, SchedulerOutput
from services.scheduler.sequence import Sequence


@dataclass(slots=True)
class Plan:
    step_id: int
    budget: int  # tokens still to hand out (a trim of drafts gives some back)
    scheduled: dict[str, int] = field(default_factory=dict)  # seq_id -> tokens to compute, in plan order
    new_blocks: dict[str, list[int]] = field(default_factory=dict)
    new_seq_ids: set[str] = field(default_factory=set)
    num_computed_before: dict[str, int] = field(default_factory=dict)
    kv_loads: dict[str, KVLoad] = field(default_factory=dict)  # new seq_id -> blocks from G2 / G3
    drafts: dict[str, list[int]] = field(default_factory=dict)  # seq_id -> tokens drafted after its input
    num_sampling: int = 0  # scheduled sequences that sample a token
    preempted: bool = False

    def to_output(
        self,
        seqs: Mapping[str, Sequence],
        block_tables: Mapping[str, list[int]],
        finished_seq_ids: tuple[str, ...],
        scheduler_id: str,
        kv_saves: tuple[KVSave, ...] = (),
        handoff: tuple[tuple[PartialSave, ...], bytes] = ((), b""),
    ) -> SchedulerOutput:
        new_seqs: list[NewSequence] = []
        seq_ids: list[str] = []
        counts: list[int] = []
        new_block_ids: list[bytes] = []
        drafts: list[bytes] = []
        for seq_id, num_tokens in self.scheduled.items():
            if seq_id in self.new_seq_ids:
                seq = seqs[seq_id]
                new_seqs.append(
                    NewSequence(
                        seq_id=seq_id,
                        prompt_token_ids=pack_tokens(seq.prompt_token_ids),
                        output_token_ids=pack_tokens(seq.output_token_ids),
                        sampling_params=seq.sampling_params,
                        stop_token_ids=tuple(sorted(seq.stop_token_ids)),
                        block_ids=pack_tokens(block_tables[seq_id]),
                        num_computed_tokens=self.num_computed_before[seq_id],
                        num_scheduled_tokens=num_tokens,
                        kv_load=self.kv_loads.get(seq_id),
                        image_spans=seq.image_spans,
                    )
                )
            else:
                seq_ids.append(seq_id)
                counts.append(num_tokens)
                new_block_ids.append(pack_tokens(self.new_blocks[seq_id]))
                drafts.append(pack_tokens(self.drafts.get(seq_id, [])))
        return SchedulerOutput(
            step_id=self.step_id,
            new_seqs=tuple(new_seqs),
            seq_ids=tuple(seq_ids),
            num_scheduled_tokens=pack_tokens(counts),
            new_block_ids=tuple(new_block_ids),
            finished_seq_ids=finished_seq_ids,
            scheduler_id=scheduler_id,
            kv_saves=kv_saves,
            partial_saves=handoff[0],
            handoff_drops=handoff[1],
            draft_token_ids=tuple(drafts) if self.drafts else (),
        )
