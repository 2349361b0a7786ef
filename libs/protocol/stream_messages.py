"""Gateway <-> gateway messages: what lets any gateway resume a request's event stream (also after
a restart) and keep Responses objects for retrieval. Frozen dataclasses on the wire like every
message (see codec)."""

from __future__ import annotations

from dataclasses import dataclass

from libs.protocol.messages import SchedulerRef, SubmitRequest


@dataclass(frozen=True, slots=True)
class StreamRecord:
    """Everything a gateway needs to re-render a request's event stream from its step outputs.

    Written at admission into the streams bucket; a resume (by any gateway, also after a restart)
    replays ``out.<gateway_id>`` from ``start_seq``, keeps this request's outputs, and renders them
    again: the rendering is deterministic, so event N is the same event N the client saw.
    """

    request_id: str
    api: str  # "chat" | "completions" | "responses" | "messages"
    gateway_id: str  # the out subject the scheduler publishes this request's outputs on
    start_seq: int  # the out stream holds nothing of this request before this sequence
    created: int  # unix seconds, as the API objects show it
    model: str
    n: int
    logprobs: bool
    top_logprobs: int
    include_usage: bool
    stop: tuple[str, ...]
    syntax: str  # output parser: "deepseek" | "hermes" | "plain"
    start: str  # the parser's first stage: "content" | "reasoning" | "tool_calls"
    parse_tool_calls: bool
    thinking: bool
    context: bytes = b""  # the API's own JSON needed to render (e.g. the Responses skeleton)
    background: bool = False  # a reader that leaves does not cancel it (Responses background)
    tenant: str = ""  # the client's tenant: only the same tenant may resume it
    # What it takes to move the request when its scheduler is lost while a resumed stream reads
    # it: the submit (outputs still go to ``gateway_id``), and every scheduler that took it, in
    # order (the last holds it now; a hand-back from an earlier one was dealt with already).
    submit: SubmitRequest | None = None
    schedulers: tuple[SchedulerRef, ...] = ()
    num_moves: int = 0  # the request's moves when the last of them took it


@dataclass(frozen=True, slots=True)
class ResumeClaim:
    request_id: str
    gateway_id: str  # who now serves the resumed stream


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A Responses API object kept for retrieval and ``previous_response_id`` chaining."""

    response_json: bytes  # the response object as the API shows it
    input_json: bytes  # the input items it answered, the chain before it included (JSON array)
    owner: str = ""  # the gateway running a background response to its end; empty once it ended
    tenant: str = ""  # whose it is: another tenant can neither read nor continue nor cancel it
