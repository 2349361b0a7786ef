"""Message schemas on the wire. Every payload is one of these frozen dataclasses (see codec).

Token ids are packed uint32 bytes (``codec.pack_tokens``). Step messages are diffs: a sequence's
prompt and sampling parameters travel to a worker once, in ``NewSequence``; afterwards a step names
it by ``seq_id`` only, and ``finished_seq_ids`` tells the worker which state to drop.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from libs.protocol.codec import unpack_tokens
from libs.protocol.kv_messages import KVLoad, KVSave, PartialSave


class FinishReason(enum.IntEnum):
    STOP = 1  # a stop token (EOS included) or, at the gateway, a stop string
    LENGTH = 2  # max_tokens or the context window
    ABORT = 3  # cancelled by the client or the gateway
    ERROR = 4  # the request failed inside the system; ``error`` says why

    @property
    def openai(self) -> str:
        return {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(self, "abort")


class StructuredOutputKind(enum.IntEnum):
    JSON = 1  # any JSON object (``json_object``)
    JSON_SCHEMA = 2  # ``spec``: the JSON Schema, as canonical JSON text
    REGEX = 3  # ``spec``: the pattern; the whole output must match it
    TOOL_TRIGGERS = 4  # free text, but a trigger starts a tool call whose body must follow its schema;
    # ``spec``: JSON {"triggers": [str], "tags": [{"begin": str, "schema": {...}, "end": str}]}
    CALL_OR_FORMAT = 5  # exactly one of: the response format, or one tool call (a tag, whole);
    # ``spec``: JSON {"format": {"schema": {...}} | {"regex": str}, "tags": [as TOOL_TRIGGERS']}
    STRUCTURE = 6  # a tree of literals, special tokens (by id), schemas and free text (a call
    # syntax with special-token markup, such as DeepSeek's DSML); ``spec``: the JSON tree that
    # libs/grammar/structure.py reads


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on what a sequence may generate, enforced by the worker's grammar masks.

    The gateway builds and validates it (a bad one is a 400 before queueing); the worker compiles
    it with ``backend`` (cached by content) and masks every sampled row that carries it.
    """

    kind: StructuredOutputKind
    spec: str = ""
    backend: str = "xgrammar"  # "xgrammar" | "outlines": the backend the gateway validated with
    prefix: str = ""  # literal text the constrained output starts with (a forced call's opening)
    suffix: str = ""  # literal text after the constrained part (a forced call's closing)
    # packed uint32 token ids: the constraint starts once the output has produced these (the end of
    # the reasoning); empty means from the first output token
    start_after: bytes = b""


@dataclass(frozen=True, slots=True)
class TokenBias:
    """OpenAI's ``logit_bias`` entry: ``bias`` (-100..100) added to the logit of ``token_id``."""

    token_id: int
    bias: float


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """OpenAI/vLLM sampling semantics. Processing order in the sampler: logit bias -> penalties ->
    temperature -> top_k -> top_p -> min_p. Logprobs are those of the raw model distribution
    (before any of it)."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off; tokens below min_p * p(most likely) are dropped
    repetition_penalty: float = 1.0  # 1 = off; over prompt and output tokens (logit / or * penalty)
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    max_tokens: int = 256
    min_tokens: int = 0  # stop tokens are masked until this many tokens are out
    stop_token_ids: tuple[int, ...] = ()  # besides EOS, which the scheduler adds unless ignore_eos
    ignore_eos: bool = False
    seed: int | None = None  # the k-th sampled token depends only on (seed, k) and the logits
    logprobs: bool = False  # return each sampled token's logprob
    top_logprobs: int = 0  # ... and this many most likely alternatives (needs logprobs)
    n: int = 1  # completions per request; they share the prompt's KV blocks
    structured_output: StructuredOutput | None = None  # grammar-constrained decoding
    logit_bias: tuple[TokenBias, ...] = ()  # distinct token ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True, slots=True)
class Logprobs:
    """Logprobs of ``num_tokens`` consecutive sampled tokens of one sequence.

    ``top_token_ids`` / ``top_logprobs`` are row-major [num_tokens, num_top], most likely first.
    """

    token_logprobs: bytes  # float32 little-endian [num_tokens]
    top_token_ids: bytes = b""  # packed uint32 [num_tokens * num_top]
    top_logprobs: bytes = b""  # float32 [num_tokens * num_top]
    num_top: int = 0

    def head(self, num_tokens: int) -> Logprobs:
        """The logprobs of the first ``num_tokens`` tokens only."""
        width = 4 * num_tokens  # float32 / uint32 entries
        return Logprobs(
            token_logprobs=self.token_logprobs[:width],
            top_token_ids=self.top_token_ids[: width * self.num_top],
            top_logprobs=self.top_logprobs[: width * self.num_top],
            num_top=self.num_top,
        )

    @staticmethod
    def concat(parts: Sequence[Logprobs]) -> Logprobs | None:
        """The logprobs of consecutive tokens as one message (one sequence's; equal ``num_top``)."""
        if len(parts) <= 1:
            return parts[0] if parts else None
        return Logprobs(
            token_logprobs=b"".join(p.token_logprobs for p in parts),
            top_token_ids=b"".join(p.top_token_ids for p in parts),
            top_logprobs=b"".join(p.top_logprobs for p in parts),
            num_top=parts[0].num_top,
        )


# --- gateway -> scheduler -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """Where one image's tokens sit in a prompt, and which image it is. The tokens themselves are
    the model's image placeholder id, alike for every image: the content hash is what tells two
    images apart, in the prefix-cache keys of the blocks they touch and in the encoder's cache."""

    mm_hash: bytes  # sha256 of the image file's bytes (32 bytes)
    offset: int  # the prompt position of its first token
    length: int  # its number of tokens (the encoder's output rows)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    request_id: str  # with n > 1, choice i runs as sequence ``seq_id_of(request_id, i)``
    gateway_id: str  # where the outputs go: subject out.<gateway_id>
    prompt_token_ids: bytes  # packed uint32
    sampling_params: SamplingParams
    eos_token_id: int
    priority: int = 0  # lower runs first
    tenant: str = ""  # salts the request's block hashes: tenants never share (or probe) cached KV
    tenant_weight: float = 1.0  # the tenant's share of admissions when tenants wait together (> 0)
    retention_class: str = ""  # how long its KV is kept in G3 ("agent", "chat", ...); "": the default
    # A resubmit, after the scheduler that had the request was lost (the gateway moves it): per
    # choice, the packed output tokens its client has received, from which it goes on; the
    # choices in ``finished_choices`` ended already and are not run again.
    output_token_ids: tuple[bytes, ...] = ()
    finished_choices: tuple[int, ...] = ()
    num_moves: int = 0  # moves to another scheduler so far (bounded by the migration limit)
    worker_id: str = ""  # the gateway's KV router picked this worker of the receiving scheduler
    num_crashes: int = 0  # worker crashes that found it in the batch so far (a suspect from one)
    # OpenAI Predicted Outputs: packed uint32, the output the client expects (drafted from)
    prediction_token_ids: bytes = b""
    traceparent: str = ""  # W3C trace context of the gateway's span (libs/runtime/tracing.py); "": none
    image_spans: tuple[ImageSpan, ...] = ()  # the prompt's images, in prompt order (encoded already)


class SubmitStatus(enum.IntEnum):
    ACCEPTED = 1
    QUEUE_FULL = 2  # -> 429 with Retry-After
    NO_WORKERS = 3  # -> 503
    INVALID = 4  # -> 400


@dataclass(frozen=True, slots=True)
class SchedulerRef:
    """One scheduler process: its id, and which start of that id (a process restarted under the
    same id is another one: it holds none of the requests the first had)."""

    scheduler_id: str
    incarnation: str = ""  # random per process start ("": a peer from before incarnations)


@dataclass(frozen=True, slots=True)
class SubmitReply:
    """The scheduler's answer to a submit (submit is request/reply, so admission is synchronous)."""

    status: SubmitStatus
    message: str = ""
    scheduler_id: str = ""  # who owns the request now: a gap in its outputs fails it
    # The last StepOutputs.seq it had sent the submitting gateway when it accepted (-1: not said):
    # the gateway then notices a loss even of the first output it is owed (its heartbeat's count).
    out_seq: int = -1
    incarnation: str = ""  # of ``scheduler_id`` (see SchedulerRef)

    @property
    def scheduler(self) -> SchedulerRef:
        return SchedulerRef(self.scheduler_id, self.incarnation)


@dataclass(frozen=True, slots=True)
class CancelRequest:
    request_ids: tuple[str, ...]


# --- scheduler -> gateway (JetStream, one message per step per gateway) ---------------------


@dataclass(frozen=True, slots=True)
class Handback:
    """A scheduler gave a request up with nothing lost: its worker is gone and it has no other
    to move it to. The gateway resubmits it elsewhere, with these counts carried on."""

    num_moves: int  # moves so far, on this scheduler and before it (bounded by the limit)
    num_crashes: int  # worker crashes it was in the batch of (at the limit it fails instead)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: bytes  # packed uint32, the tokens generated in this step
    num_output_tokens: int  # total after this step; lets the gateway detect a lost message
    num_prompt_tokens: int
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    error: str = ""
    index: int = 0  # the choice, when the request asked for n > 1
    logprobs: Logprobs | None = None  # of new_token_ids, when the request asked for them
    # with finish_reason ERROR: the request may go on elsewhere (the error says why it left)
    handback: Handback | None = None
    # since the last output of this choice: its prediction's tokens that were drafted and ended
    # in the output (accepted) or were drafted and did not (rejected)
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StepOutputs:
    scheduler_id: str
    seq: int  # per (scheduler process, gateway), +1 per message; a gap means something was lost
    outputs: tuple[RequestOutput, ...]
    incarnation: str = ""  # of ``scheduler_id``: a restarted scheduler numbers afresh

    @property
    def scheduler(self) -> SchedulerRef:
        return SchedulerRef(self.scheduler_id, self.incarnation)


# --- scheduler <-> worker -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NewSequence:
    """A sequence the worker does not hold yet: first scheduled, or resumed after preemption."""

    seq_id: str
    prompt_token_ids: bytes  # packed uint32
    output_token_ids: bytes  # packed uint32; non-empty when resuming (they are recomputed)
    sampling_params: SamplingParams
    stop_token_ids: tuple[int, ...]  # EOS (unless ignore_eos) + the request's; masked before min_tokens
    block_ids: bytes  # packed uint32: its whole block table so far
    num_computed_tokens: int  # tokens whose KV already sits in those blocks (a shared prefix)
    num_scheduled_tokens: int  # tokens to compute in this step, from num_computed_tokens on
    kv_load: KVLoad | None = None  # blocks among the computed ones to fill from G2 / G3 first
    image_spans: tuple[ImageSpan, ...] = ()  # the prompt's images (their embeddings: the media store)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan, as a diff against what the worker already holds.

    A scheduled sequence computes the KV of ``num_scheduled_tokens`` tokens starting at its
    ``num_computed_tokens`` (a prefill chunk, or 1 for decode) and samples one token when that
    reaches the end of the tokens the worker knows. With overlap scheduling a decode's input is
    the token the worker sampled in the previous plan, which the scheduler has not seen yet.

    Speculative decoding: a decode may carry drafted tokens (``draft_token_ids``). The worker
    computes them after its input token, samples at every one of those positions, keeps the
    drafts up to the first that differs from its own sample, and returns that many + 1 tokens.
    The scheduler allocated blocks for all of them; a drafted sequence is in no later plan until
    this one's result has come back.
    """

    step_id: int
    new_seqs: tuple[NewSequence, ...] = ()
    seq_ids: tuple[str, ...] = ()  # sequences the worker already holds, scheduled in this step
    num_scheduled_tokens: bytes = b""  # packed uint32, one per seq_ids
    new_block_ids: tuple[bytes, ...] = ()  # packed uint32 per seq_ids: appended to its block table
    finished_seq_ids: tuple[str, ...] = ()  # drop their state first (finished, aborted, preempted)
    scheduler_id: str = ""  # the sender; a worker serves one owner and drops all it holds if that goes
    kv_saves: tuple[KVSave, ...] = ()  # blocks to keep in G2 / G3, saved before this step's forward
    partial_saves: tuple[PartialSave, ...] = ()  # P/D handoffs' partial blocks, saved with kv_saves
    # Concatenated keys of handoff-area files no plan will load (the request ended or moved on
    # without them): deleted after this worker's earlier partial saves are written.
    handoff_drops: bytes = b""
    # packed uint32 per seq_ids: tokens drafted after its input token (b"": none); empty: none at all
    draft_token_ids: tuple[bytes, ...] = ()

    @property
    def num_scheduled_seqs(self) -> int:
        return len(self.new_seqs) + len(self.seq_ids)


# --speculative-method, which the scheduler and the worker both take: where drafts come from.
# ngram and suffix are the scheduler's; mtp is the worker's model's (ModelRunnerOutput.draft_*).
SPECULATIVE_METHODS: Final = ("none", "ngram", "suffix", "mtp")


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """Tokens sampled in a step, in plan order (new_seqs, then seq_ids), for the sequences whose
    scheduled tokens reached their end; a prefill chunk that does not samples nothing."""

    step_id: int
    seq_ids: tuple[str, ...]
    sampled_token_ids: bytes  # packed uint32, one per seq_id (a drafted one: 1 + its accepted drafts)
    num_running_seqs: int  # sequences whose state the worker holds after this step
    logprobs: tuple[Logprobs | None, ...] = ()  # one per seq_id (all its tokens'), or empty when none asked
    error: str = ""  # the whole step failed; the worker dropped every sequence
    # Sequences that cannot go on (their grammar failed to compile), with why. Each still sampled a
    # stop token above, so the worker's state stays in step with plans already in flight.
    failed_seq_ids: tuple[str, ...] = ()
    failed_errors: tuple[str, ...] = ()
    # KV loads of this step's new sequences: blocks filled from G2, from G3, and recomputed instead
    num_loaded_host_blocks: int = 0
    num_loaded_store_blocks: int = 0
    num_failed_load_blocks: int = 0
    num_loaded_partial_blocks: int = 0  # P/D handoffs' partial blocks read from the handoff area
    num_failed_partial_blocks: int = 0  # ... and those recomputed instead
    # the sequences whose load stopped short, and the blocks each recomputed instead (in all:
    # num_failed_load_blocks): what they report as cached shrinks by as much
    failed_load_seq_ids: tuple[str, ...] = ()
    failed_load_num_blocks: tuple[int, ...] = ()
    # packed uint32, tokens per seq_id in sampled_token_ids; b"": one each (no drafts in the plan)
    num_sampled_tokens: bytes = b""
    forward_time_s: float = 0.0  # the worker's time computing and sampling this step (0: not measured)
    # The worker's own drafts (an MTP module): packed uint32, per seq_id the token proposed after
    # its last one above, and that token's probability under the drafter; b"" / (): none.
    draft_token_ids: bytes = b""
    draft_probs: tuple[float, ...] = ()

    def drafts(self) -> list[tuple[int, float]] | None:
        """The worker's drafts, (token, probability) per seq_id; None when it sent none, or a
        malformed set (drafts are optional: dropped rather than failing the step)."""
        token_ids = unpack_tokens(self.draft_token_ids) if self.draft_token_ids else []
        if not token_ids or not len(token_ids) == len(self.draft_probs) == len(self.seq_ids):
            return None
        return list(zip(token_ids, self.draft_probs, strict=True))


def seq_id_of(request_id: str, index: int) -> str:
    """The sequence running choice ``index`` of a request (choice 0 keeps the request id)."""
    return request_id if index == 0 else f"{request_id}#{index}"


@dataclass(frozen=True, slots=True)
class PauseRequest:
    """Gateway -> schedulers: stop computing these requests (every choice) until a resume, or
    (``resume``) go on with them. A resumable stream's last reader left: its sequences leave the
    worker at once, their computed blocks stay in the prefix cache, and a resume recomputes over
    that hit. ``timeout_s``: when no resume or cancel came by then, the scheduler cancels it (its
    gateway may be gone); 0 means the scheduler's own ``pause_timeout_s``."""

    request_ids: tuple[str, ...]
    resume: bool = False
    timeout_s: float = 0.0
    # The sender. A pause and a resume from two gateways are not ordered: a pause from another
    # gateway than the one whose reader resumed the request since is stale, and ignored.
    gateway_id: str = ""
