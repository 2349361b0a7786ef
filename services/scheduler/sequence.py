"""A request's state inside the scheduler: its tokens, parameters and where it stands."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from libs.protocol.messages import FinishReason, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # admitted, not yet sent to the worker
    RUNNING = enum.auto()  # the worker holds its state
    FINISHED = enum.auto()


@dataclass(eq=False)
class Sequence:
    seq_id: str  # the request id
    gateway_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int
    priority: int = 0
    arrival: int = 0  # admission order, the FCFS tie-break
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_sent_tokens: int = 0  # output tokens already published to the gateway
    stop_token_ids: frozenset[int] = field(init=False)  # EOS unless ignore_eos, plus the request's

    def __post_init__(self) -> None:
        ids = set(self.sampling_params.stop_token_ids)
        if not self.sampling_params.ignore_eos:
            ids.add(self.eos_token_id)
        self.stop_token_ids = frozenset(ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
