"""Message schemas on the wire. Every payload is one of these frozen dataclasses (see codec).

Token ids are packed uint32 bytes (``codec.pack_tokens``). Step messages are diffs: a sequence's
prompt and sampling parameters travel to a worker once, in ``NewSequence``; afterwards a step names
it by ``seq_id`` only, and ``finished_seq_ids`` tells the worker which state to drop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(enum.IntEnum):
    STOP = 1  # a stop token (EOS included) or, at the gateway, a stop string
    LENGTH = 2  # max_tokens or the context window
    ABORT = 3  # cancelled by the client or the gateway
    ERROR = 4  # the request failed inside the system; ``error`` says why

    @property
    def openai(self) -> str:
        return {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(self, "abort")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()  # besides EOS, which the scheduler adds unless ignore_eos
    ignore_eos: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# --- gateway -> scheduler -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    request_id: str
    gateway_id: str  # where the outputs go: subject out.<gateway_id>
    prompt_token_ids: bytes  # packed uint32
    sampling_params: SamplingParams
    eos_token_id: int
    priority: int = 0  # lower runs first
    tenant: str = ""


class SubmitStatus(enum.IntEnum):
    ACCEPTED = 1
    QUEUE_FULL = 2  # -> 429 with Retry-After
    NO_WORKERS = 3  # -> 503
    INVALID = 4  # -> 400


@dataclass(frozen=True, slots=True)
class SubmitReply:
    """The scheduler's answer to a submit (submit is request/reply, so admission is synchronous)."""

    status: SubmitStatus
    message: str = ""
    scheduler_id: str = ""  # who owns the request now: a gap in its outputs fails it


@dataclass(frozen=True, slots=True)
class CancelRequest:
    request_ids: tuple[str, ...]


# --- scheduler -> gateway (JetStream, one message per step per gateway) ---------------------


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: bytes  # packed uint32, the tokens generated in this step
    num_output_tokens: int  # total after this step; lets the gateway detect a lost message
    num_prompt_tokens: int
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class StepOutputs:
    scheduler_id: str
    seq: int  # per (scheduler, gateway), +1 per message; a gap means something was lost
    outputs: tuple[RequestOutput, ...]


# --- scheduler <-> worker -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NewSequence:
    seq_id: str
    prompt_token_ids: bytes  # packed uint32
    sampling_params: SamplingParams


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan: prefill ``new_seqs``, decode one token for ``decode_seq_ids``."""

    step_id: int
    new_seqs: tuple[NewSequence, ...] = ()
    decode_seq_ids: tuple[str, ...] = ()
    finished_seq_ids: tuple[str, ...] = ()  # drop their state before running the step
    scheduler_id: str = ""  # the sender; a worker frees the sequences of a scheduler gone silent

    @property
    def num_scheduled_seqs(self) -> int:
        return len(self.new_seqs) + len(self.decode_seq_ids)


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """Sampled tokens in plan order: new_seqs first, then decode_seq_ids."""

    step_id: int
    seq_ids: tuple[str, ...]
    sampled_token_ids: bytes  # packed uint32, one per seq_id
    num_running_seqs: int  # sequences whose state the worker holds after this step
    failed_seq_ids: tuple[str, ...] = ()  # dropped by the worker (KV cache full); not in seq_ids
    error: str = ""  # the whole step failed


# --- liveness and load ----------------------------------------------------------------------


class MemberKind(enum.IntEnum):
    GATEWAY = 1
    SCHEDULER = 2
    WORKER = 3


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """Value of ``<kind>.<id>`` in the members bucket; refreshed well within the bucket's TTL."""

    kind: MemberKind
    member_id: str
    model: str = ""
    ready: bool = True


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """Published by a worker after each step and periodically while idle."""

    worker_id: str
    num_running_seqs: int
    max_num_seqs: int
    max_model_len: int
    step_time_ms: float = 0.0
    model: str = ""
