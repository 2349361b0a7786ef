"""A sequence's state inside the scheduler: its tokens, parameters and how far its KV is computed."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from libs.protocol.messages import FinishReason, Handback, ImageSpan, Logprobs, SamplingParams, seq_id_of


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # admitted (or preempted), the worker holds no state for it
    RUNNING = enum.auto()  # the worker holds its state and KV blocks
    PAUSED = enum.auto()  # its client left: like WAITING, but never scheduled until resumed
    FINISHED = enum.auto()


@dataclass(eq=False)
class Sequence:
    """One choice of a request. Choice 0's ``seq_id`` is the request id (see ``seq_id_of``).

    KV accounting runs ahead of results: ``num_computed_tokens`` counts the tokens whose KV the
    worker will hold once every plan sent so far has run, and ``num_pending_tokens`` the tokens
    those plans will sample but whose values have not arrived yet (overlap scheduling keeps up to
    two plans in flight). So the worker knows ``num_tokens + num_pending_tokens`` tokens.
    """

    seq_id: str
    gateway_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int
    priority: int = 0  # lower runs first
    tenant: str = ""  # salts its block hashes: tenants never share KV
    tenant_weight: float = 1.0  # its tenant's share of admissions (services/scheduler/fair_queue.py)
    retention_class: str = ""  # how long G3 keeps the blocks it saves ("": the store's default)
    request_id: str = ""  # defaults to seq_id (choice 0)
    index: int = 0  # the choice
    arrival: int = 0  # admission order, the FCFS tie-break
    queued_at: float = 0.0  # when it was queued (monotonic, set by its placer); 0 once first admitted
    traceparent: str = ""  # the request's trace (libs/runtime/tracing.py): its spans' parent
    image_spans: tuple[ImageSpan, ...] = ()  # its prompt's images (in its block hashes, to the worker)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str = ""  # why it finished with ERROR, when that is the sequence's own fault
    handback: Handback | None = None  # with ERROR: given back to the gateway to move elsewhere
    num_sent_tokens: int = 0  # output tokens already published to the gateway
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    prompt_done_step: int = 0  # the step whose plan computes the prompt's last chunk (0: none yet)
    num_preemptions: int = 0
    num_pauses: int = 0  # pauses that took it off the worker (it was running)
    num_moves: int = 0  # moves that took it off a worker it was running on (see moving)
    # in a crashed worker's batch: admitted alone among suspects until it samples a token again
    suspect: bool = False
    # prefilled here, decoded on another worker: not scheduled past its first token (see handoff)
    handoff: bool = False
    pause_deadline: float = 0.0  # while PAUSED: when it is cancelled unless resumed (caller's clock)
    # prompt tokens its first admission took from G1, G2 or G3 (less any load the worker recomputed)
    num_cached_tokens: int = 0
    cached_step: int = 0  # the step whose plan admitted it first: the loads num_cached_tokens counts
    num_stored_blocks: int = 0  # leading blocks of its prompt chain in G3 when it was submitted
    num_saved_blocks: int = 0  # leading full blocks already sent to the worker in saves
    # [first, end) blocks its admission's load fills: in the tiers already, its saves skip them
    loaded_blocks: tuple[int, int] = (0, 0)
    # handed off: the handoff area holds its partial last prompt block under this key, until a
    # decode worker's admission plans its load (or drops it); b"": none
    partial_key: bytes = b""
    block_hashes: list[bytes] = field(default_factory=list)  # chain over full blocks, grown lazily
    unsent_logprobs: list[Logprobs] = field(default_factory=list)
    # the drafts its plan in flight verifies ([]: none); it is in no later plan until that result
    draft_token_ids: list[int] = field(default_factory=list)
    draft_source: str = ""  # where its last draft came from (a speculation.SOURCES name)
    draft_match_len: int = 0  # tokens of its context the last draft's source matched
    # the request's predicted output (OpenAI Predicted Outputs), drafted from ([]: none)
    prediction_token_ids: list[int] = field(default_factory=list)
    # prediction tokens drafted since its last output message: ended in the output, or not
    num_unsent_accepted_prediction_tokens: int = 0
    num_unsent_rejected_prediction_tokens: int = 0
    stop_token_ids: frozenset[int] = field(init=False)  # EOS unless ignore_eos, plus the request's

    def __post_init__(self) -> None:
        self.request_id = self.request_id or self.seq_id
        ids = set(self.sampling_params.stop_token_ids)
        if not self.sampling_params.ignore_eos:
            ids.add(self.eos_token_id)
        self.stop_token_ids = frozenset(ids)

    def choice(self, index: int) -> Sequence:
        """Choice ``index`` of the same request; a seeded request gets seed + index so choices differ."""
        params = self.sampling_params
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + index)
        return Sequence(
            seq_id_of(self.request_id, index),
            self.gateway_id,
            self.prompt_token_ids,
            params,
            self.eos_token_id,
            priority=self.priority,
            tenant=self.tenant,
            tenant_weight=self.tenant_weight,
            retention_class=self.retention_class,
            request_id=self.request_id,
            queued_at=self.queued_at,
            traceparent=self.traceparent,
            image_spans=self.image_spans,
            index=index,
            num_stored_blocks=self.num_stored_blocks,
            prediction_token_ids=self.prediction_token_ids,
        )

    def going_on_from(self, output_token_ids: list[int]) -> Sequence:
        """This choice, resubmitted with the output tokens its client has (they are not sent
        again; sampling depends on (seed, position) only, so the next ones come out the same)."""
        self.output_token_ids = list(output_token_ids)
        self.num_sent_tokens = len(output_token_ids)
        return self

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output."""
        p = self.num_prompt_tokens
        prompt = self.prompt_token_ids[start : min(end, p)]
        return prompt + self.output_token_ids[max(start - p, 0) : max(end - p, 0)]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the worker knows (or will) whose KV is not computed yet."""
        return self.num_tokens + self.num_pending_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def order(self) -> tuple[int, int, int]:
        """Scheduling order: priority, then arrival, then choice."""
        return (self.priority, self.arrival, self.index)
