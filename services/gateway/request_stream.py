"""One request's step outputs as the HTTP side consumes them: checked deltas, per choice, in order.

``Pending`` turns a request's ``RequestOutput``s into ``Delta``s and checks that nothing was lost
(each output carries its choice's running token count). ``RequestStream`` iterates them; the
same classes serve a live request and a resumed one replayed from the out stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from libs.protocol.codec import pack_tokens, unpack_tokens
from libs.protocol.messages import FinishReason, RequestOutput, SchedulerRef, SubmitRequest, seq_id_of
from libs.protocol.stream_messages import StreamRecord
from services.gateway.grace import OnLeave
from services.gateway.logprobs import TokenLogprob, unpack_logprobs


@dataclass(frozen=True, slots=True)
class Delta:
    """New tokens of one choice of a request from one step."""

    token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int  # of this choice
    num_cached_tokens: int
    finish_reason: FinishReason | None
    error: str = ""
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked for them
    # of its prediction's tokens drafted in this step: in the output, or not (Predicted Outputs)
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0


@dataclass(eq=False)
class Pending:
    """One reader's view of a request: its deltas, and what it takes to move the request.

    ``scheduler`` is the scheduler process its outputs come from now (from the submit's reply,
    and from the outputs themselves: a resumed stream learns a move by another gateway that way)."""

    n: int
    want_logprobs: bool
    scheduler: SchedulerRef | None = None
    queue: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    # Per choice: the consumer has seen its end (or stopped it); later deltas for it are dropped.
    done: list[bool] = field(default_factory=list)
    # Per choice, the output tokens received: their count checks each output's running count, and
    # with ``submit`` and ``ended`` they are what it takes to resubmit the request elsewhere.
    received: list[list[int]] = field(default_factory=list)
    submit: SubmitRequest | None = None  # what was submitted (a live request; not a replay)
    ended: list[bool] = field(default_factory=list)  # per choice: the scheduler said it ended
    num_moves: int = 0  # resubmits so far
    on_leave: OnLeave = "now"  # what its reader's leaving does: cancel, pause for a grace, nothing
    lost_schedulers: set[SchedulerRef] = field(
        default_factory=set
    )  # outputs still coming from them are dropped
    num_crashes: int = 0  # worker crashes it was in the batch of (said by a hand-back)
    request_id: str = ""
    record: StreamRecord | None = None  # a resumable request's record, as last stored
    # A replay's view of what happened before it started: the schedulers the request had left
    # (their outputs tell nothing of where it is now), and the moves it had made (a hand-back
    # counting fewer is old news, dealt with already).
    past_schedulers: frozenset[SchedulerRef] = frozenset()
    num_moves_before: int = 0
    caught_up: bool = True  # a replay has read the out stream up to where it was at its start
    accepted_at: float = 0.0  # when its scheduler took it, or this replay started (monotonic)
    moving: bool = False  # a resubmit is under way
    avoid: SchedulerRef | None = None  # the scheduler that handed it back: tried last
    orphan_since: float | None = None  # its scheduler left it and another gateway is to move it
    reader_left: bool = False
    claimed_away: bool = False  # another gateway resumed it: that one moves it
    failed: bool = False

    def __post_init__(self) -> None:
        self.done = [False] * self.n
        self.received = [[] for _ in range(self.n)]
        self.ended = [False] * self.n

    @classmethod
    def replaying(cls, record: StreamRecord, now: float) -> Pending:
        """The reader of a resumed stream: what its record says of the request's moves so far (a
        scheduler taken again later is not one it has left)."""
        current = record.schedulers[-1] if record.schedulers else None
        return cls(
            record.n,
            record.logprobs,
            scheduler=current,
            submit=record.submit,
            num_moves=record.num_moves,
            request_id=record.request_id,
            record=record,
            past_schedulers=frozenset(record.schedulers[:-1]) - {current},
            num_moves_before=record.num_moves,
            accepted_at=now,
            caught_up=False,
        )

    def resubmission(self) -> SubmitRequest | None:
        """The submit that lets another scheduler go on from what has been received; None if
        nothing is left to run (every choice ended, or this reader does not resubmit)."""
        if self.submit is None:
            return None
        finished = tuple(i for i in range(self.n) if self.ended[i] or self.done[i])
        if len(finished) == self.n:
            return None
        return dataclasses.replace(
            self.submit,
            output_token_ids=tuple(pack_tokens(tokens) for tokens in self.received),
            finished_choices=finished,
            num_moves=self.num_moves,
            num_crashes=self.num_crashes,
        )

    def deliver(self, scheduler: SchedulerRef, out: RequestOutput) -> bool:
        """Take an output from ``scheduler``; True when it hands the request back (its tokens
        stand, its end does not: the request goes on elsewhere). A replay's old news (from a
        scheduler it had left before the replay started) moves nothing."""
        if scheduler in self.lost_schedulers:
            return False  # taken for lost: the request went on elsewhere
        if scheduler not in self.past_schedulers:
            self.scheduler = scheduler
            self.orphan_since = None
        if out.handback is None:
            self.accept(out)
            return False
        if out.new_token_ids:
            self.accept(dataclasses.replace(out, finish_reason=None, error="", handback=None))
        return scheduler not in self.past_schedulers and out.handback.num_moves >= self.num_moves_before

    def accept(self, out: RequestOutput) -> None:
        """Queue one output as a delta; a lost message or bad payload ends its choice with an error."""
        if not 0 <= out.index < self.n:
            self.fail(f"output for choice {out.index} of a request with n={self.n}")
            return
        token_ids = unpack_tokens(out.new_token_ids)
        received = self.received[out.index]
        received.extend(token_ids)
        error, finish = out.error, out.finish_reason
        logprobs: tuple[TokenLogprob, ...] = ()
        if len(received) != out.num_output_tokens:
            error = f"lost tokens: have {len(received)}, scheduler sent {out.num_output_tokens}"
            finish = FinishReason.ERROR
        elif self.want_logprobs and token_ids:
            try:
                if out.logprobs is None:
                    raise ValueError("no logprobs")
                logprobs = unpack_logprobs(token_ids, out.logprobs)
            except ValueError as exc:
                error, finish = f"bad logprobs from the scheduler: {exc}", FinishReason.ERROR
        self.ended[out.index] = self.ended[out.index] or finish is not None
        self.queue.put_nowait(
            Delta(
                token_ids,
                out.num_prompt_tokens,
                out.num_output_tokens,
                out.num_cached_tokens,
                finish,
                error,
                out.index,
                logprobs,
                out.num_accepted_prediction_tokens,
                out.num_rejected_prediction_tokens,
            )
        )

    def fail(self, why: str) -> None:
        """End every choice with an error (the consumer skips those it has seen end already)."""
        self.failed = True
        for index in range(self.n):
            self.queue.put_nowait(Delta([], 0, len(self.received[index]), 0, FinishReason.ERROR, why, index))


class RequestStream:
    """One admitted request's deltas, every choice interleaved in arrival order.

    Iteration ends once every choice is done. ``stop_choice`` ends one choice early (a stop
    string); ``close()`` before the end (disconnect, error) hands the request to ``on_close``
    (which cancels it at once, after the resume grace period, or not at all).
    """

    def __init__(
        self,
        request_id: str,
        pending: Pending,
        cancel: Callable[[str], None],
        on_close: Callable[[RequestStream, bool], None],
    ) -> None:
        self.request_id = request_id
        self._pending = pending
        self._cancel = cancel
        self._on_close = on_close
        self._closed = False

    @property
    def finished(self) -> bool:
        return all(self._pending.done)

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Delta]:
        async for delta in self.deltas(None):
            if delta is not None:
                yield delta

    async def deltas(self, idle_s: float | None) -> AsyncIterator[Delta | None]:
        """The deltas, and None whenever none came for ``idle_s`` (a keep-alive is due)."""
        done, queue = self._pending.done, self._pending.queue
        while not all(done):
            try:
                async with asyncio.timeout(idle_s):  # Queue.get is cancel-safe: nothing is lost
                    delta = await queue.get()
            except TimeoutError:
                yield None
                continue
            if done[delta.index]:
                continue  # tokens still in flight for a choice stopped here
            done[delta.index] = delta.finish_reason is not None
            yield delta

    def stop_choice(self, index: int) -> None:
        """End choice ``index`` here; the scheduler drops its sequence unless it had finished already."""
        if not self._pending.done[index]:
            self._pending.done[index] = True
            self._cancel(seq_id_of(self.request_id, index))

    def close(self, failed: bool = False) -> None:
        """Idempotent and synchronous, so it is safe in a finally block of a cancelled task.

        ``failed``: the reader gave up on an error; what still runs is cancelled at once."""
        if not self._closed:
            self._closed = True
            self._on_close(self, failed)
