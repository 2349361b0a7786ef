"""The gateway's bus side: submit/cancel, and one consumer that demuxes step outputs to requests.

All step outputs for this gateway arrive on one ordered JetStream consumer (subject
``out.<gateway_id>``), never one per request. Two checks make a loss loud instead of silent: each
scheduler numbers its messages to this gateway (a gap fails that scheduler's requests), and each
output carries its choice's running token count (a mismatch fails that choice).

A request with n > 1 is one submit; the scheduler runs choice i as sequence
``seq_id_of(request_id, i)`` and tags its outputs with ``index`` i. The request is over when every
choice is: finished by the scheduler, or stopped here (a stop string cancels just that sequence).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from libs.bus.base import Bus, Message, NoResponders
from libs.bus.membership import live_members
from libs.protocol.codec import DecodeError, decode, encode, pack_tokens, unpack_tokens
from libs.protocol.messages import (
    CancelRequest,
    FinishReason,
    MemberKind,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    SubmitReply,
    SubmitRequest,
    SubmitStatus,
    seq_id_of,
)
from libs.protocol.subjects import Subjects
from services.gateway.logprobs import TokenLogprob, unpack_logprobs

log = logging.getLogger(__name__)


class SubmitRejected(Exception):
    def __init__(self, status: SubmitStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Delta:
    """New tokens of one choice of a request from one step, as the HTTP side consumes them."""

    token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int  # of this choice
    num_cached_tokens: int
    finish_reason: FinishReason | None
    error: str = ""
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked for them


@dataclass(eq=False)
class _Pending:
    n: int
    want_logprobs: bool
    scheduler_id: str = ""
    queue: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    num_received: list[int] = field(default_factory=list)  # per choice
    # Per choice: the consumer has seen its end (or stopped it); later deltas for it are dropped.
    done: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_received = [0] * self.n
        self.done = [False] * self.n


class RequestStream:
    """One admitted request's deltas, every choice interleaved in arrival order.

    Iteration ends once every choice is done. ``stop_choice`` ends one choice early (a stop
    string); ``close()`` before the end (disconnect, error) cancels whatever still runs.
    """

    def __init__(self, service: GatewayService, request_id: str, pending: _Pending) -> None:
        self.request_id = request_id
        self._service = service
        self._pending = pending
        self._closed = False

    @property
    def finished(self) -> bool:
        return all(self._pending.done)

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Delta]:
        done = self._pending.done
        while not all(done):
            delta = await self._pending.queue.get()
            if done[delta.index]:
                continue  # tokens still in flight for a choice stopped here
            done[delta.index] = delta.finish_reason is not None
            yield delta

    def stop_choice(self, index: int) -> None:
        """End choice ``index`` here; the scheduler drops its sequence unless it had finished already."""
        if not self._pending.done[index]:
            self._pending.done[index] = True
            self._service.cancel_soon(seq_id_of(self.request_id, index))

    def close(self) -> None:
        """Idempotent and synchronous, so it is safe in a finally block of a cancelled task."""
        if not self._closed:
            self._closed = True
            self._service._forget(self.request_id, cancel=not self.finished)


class GatewayService:
    def __init__(self, bus: Bus, subjects: Subjects, gateway_id: str, submit_timeout_s: float) -> None:
        self.bus = bus
        self.subjects = subjects
        self.gateway_id = gateway_id
        self.submit_timeout_s = submit_timeout_s
        self._pending: dict[str, _Pending] = {}
        self._last_seq: dict[str, int] = {}  # scheduler id -> last StepOutputs.seq seen
        self._background: set[asyncio.Task[None]] = set()

    async def start(self, out_max_age_s: float = 600.0) -> None:
        await self.bus.ensure_stream(self.subjects.out_stream, [self.subjects.out_all], out_max_age_s)
        await self.bus.subscribe_durable(self.subjects.out(self.gateway_id), self._on_step_outputs)

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    async def healthy(self) -> bool:
        bucket = self.subjects.members_bucket
        return bool(await live_members(self.bus, bucket, MemberKind.WORKER)) and bool(
            await live_members(self.bus, bucket, MemberKind.SCHEDULER)
        )

    async def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, eos_token_id: int
    ) -> RequestStream:
        """Admit the request (raises SubmitRejected) and return the stream of its deltas."""
        req = SubmitRequest(request_id, self.gateway_id, pack_tokens(prompt_token_ids), params, eos_token_id)
        # Registered before the submit goes out, so no output can arrive before its queue exists.
        pending = self._pending[request_id] = _Pending(params.n, params.logprobs)
        try:
            raw = await self.bus.request(self.subjects.submit, encode(req), self.submit_timeout_s)
            reply = decode(SubmitReply, raw)
        except NoResponders as exc:
            self._pending.pop(request_id, None)
            raise SubmitRejected(SubmitStatus.NO_WORKERS, "no scheduler is available") from exc
        except BaseException:  # timed out or cancelled: the scheduler may still have admitted it
            self._pending.pop(request_id, None)
            self.cancel_soon(request_id)
            raise
        if reply.status is not SubmitStatus.ACCEPTED:
            self._pending.pop(request_id, None)
            raise SubmitRejected(reply.status, reply.message)
        pending.scheduler_id = reply.scheduler_id
        return RequestStream(self, request_id, pending)

    def _forget(self, request_id: str, cancel: bool) -> None:
        self._pending.pop(request_id, None)
        if cancel:
            self.cancel_soon(request_id)

    def cancel_soon(self, request_id: str) -> None:
        """Publish a cancel without awaiting: safe from a cancelled task or a finally block."""
        task = asyncio.get_running_loop().create_task(
            self.bus.publish(self.subjects.cancel, encode(CancelRequest((request_id,))))
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _on_step_outputs(self, msg: Message) -> None:
        try:
            step = decode(StepOutputs, msg.data)
        except DecodeError as exc:
            log.error("undecodable step outputs at stream seq %d: %s", msg.seq, exc)
            return
        last = self._last_seq.get(step.scheduler_id)
        self._last_seq[step.scheduler_id] = step.seq
        if last is not None and step.seq != last + 1:
            self._fail_scheduler(step.scheduler_id, f"lost step outputs {last + 1}..{step.seq - 1}")
        for out in step.outputs:
            self._dispatch(out)

    def _dispatch(self, out: RequestOutput) -> None:
        pending = self._pending.get(out.request_id)
        if pending is None:
            return  # cancelled here already, or answered by an older gateway with our id
        if not 0 <= out.index < pending.n:
            self._fail(pending, f"output for choice {out.index} of a request with n={pending.n}")
            return
        token_ids = unpack_tokens(out.new_token_ids)
        pending.num_received[out.index] += len(token_ids)
        error, finish = out.error, out.finish_reason
        logprobs: tuple[TokenLogprob, ...] = ()
        if pending.num_received[out.index] != out.num_output_tokens:
            have = pending.num_received[out.index]
            error = f"lost tokens: have {have}, scheduler sent {out.num_output_tokens}"
            finish = FinishReason.ERROR
        elif pending.want_logprobs and token_ids:
            try:
                if out.logprobs is None:
                    raise ValueError("no logprobs")
                logprobs = unpack_logprobs(token_ids, out.logprobs)
            except ValueError as exc:
                error, finish = f"bad logprobs from the scheduler: {exc}", FinishReason.ERROR
        pending.queue.put_nowait(
            Delta(
                token_ids,
                out.num_prompt_tokens,
                out.num_output_tokens,
                out.num_cached_tokens,
                finish,
                error,
                out.index,
                logprobs,
            )
        )

    def _fail_scheduler(self, scheduler_id: str, why: str) -> None:
        log.error("scheduler %s: %s", scheduler_id, why)
        for pending in self._pending.values():
            if pending.scheduler_id == scheduler_id:
                self._fail(pending, why)

    @staticmethod
    def _fail(pending: _Pending, why: str) -> None:
        """End every choice with an error (the consumer skips those it has seen end already)."""
        for index in range(pending.n):
            received = pending.num_received[index]
            pending.queue.put_nowait(Delta([], 0, received, 0, FinishReason.ERROR, why, index))
