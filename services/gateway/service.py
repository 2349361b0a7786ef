"""The gateway's bus side: submit/cancel, and one consumer that demuxes step outputs to requests.

All step outputs for this gateway arrive on one ordered JetStream consumer (subject
``out.<gateway_id>``), never one per request. Two checks make a loss loud instead of silent: each
scheduler numbers its messages to this gateway (a gap fails that scheduler's requests), and each
output carries its choice's running token count (a mismatch fails that choice).

A request with n > 1 is one submit; the scheduler runs choice i as sequence
``seq_id_of(request_id, i)`` and tags its outputs with ``index`` i. The request is over when every
choice is: finished by the scheduler, or stopped here (a stop string cancels just that sequence).

Resume: at admission a ``StreamRecord`` goes into the streams bucket (where the outputs will be in
the out stream, and how to render them). A client that went away leaves its request running for
``resume_grace_s``; a reconnect, here or at any gateway, replays the out stream from the record
and claims the request (``ResumeClaim``), so the cancel never comes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from libs.bus.base import Bus, Message, NoResponders, Subscription
from libs.bus.membership import MEMBER_TTL_S, live_members, member_key
from libs.protocol.codec import DecodeError, decode, decode_or_warn, encode, pack_tokens
from libs.protocol.kv_messages import KVCacheStats
from libs.protocol.messages import (
    CancelRequest,
    MemberInfo,
    MemberKind,
    ResumeClaim,
    SamplingParams,
    StepOutputs,
    StreamRecord,
    SubmitReply,
    SubmitRequest,
    SubmitStatus,
)
from libs.protocol.subjects import Subjects
from services.gateway.grace import GracePeriods, OnLeave
from services.gateway.metrics import StatsBoard
from services.gateway.request_stream import Pending, RequestStream

log = logging.getLogger(__name__)


class SubmitRejected(Exception):
    def __init__(self, status: SubmitStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class GatewayService:
    """``resume_grace_s``: how long a request outlives its client's disconnect (0: cancel at once)."""

    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        gateway_id: str,
        submit_timeout_s: float,
        resume_grace_s: float = 0.0,
        out_max_age_s: float = 600.0,
    ) -> None:
        self.bus = bus
        self.subjects = subjects
        self.gateway_id = gateway_id
        self.submit_timeout_s = submit_timeout_s
        self.out_max_age_s = out_max_age_s
        self._pending: dict[str, Pending] = {}
        self._last_seq: dict[str, int] = {}  # scheduler id -> last StepOutputs.seq seen
        self._background: set[asyncio.Task[None]] = set()
        self._grace = GracePeriods(resume_grace_s, self.cancel_soon)
        self._out_seq_seen = 0  # the newest out stream sequence this gateway has seen
        self.kv_stats = StatsBoard()  # every service's latest KV-cache stats, for /metrics

    async def start(self) -> None:
        subjects = self.subjects
        await self.bus.ensure_stream(subjects.out_stream, [subjects.out_all], self.out_max_age_s)
        await self.bus.ensure_kv(subjects.streams_bucket, self.out_max_age_s)
        await self.bus.ensure_kv(subjects.members_bucket, MEMBER_TTL_S)
        await self.bus.subscribe(subjects.resume_claim, self._on_claim)
        await self.bus.subscribe(subjects.stats_all, self._on_stats)
        self._out_seq_seen = await self.bus.stream_last_seq(subjects.out_stream)
        await self.bus.subscribe_durable(subjects.out(self.gateway_id), self._on_step_outputs)

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    async def healthy(self) -> bool:
        bucket = self.subjects.members_bucket
        return bool(await live_members(self.bus, bucket, MemberKind.WORKER)) and bool(
            await live_members(self.bus, bucket, MemberKind.SCHEDULER)
        )

    async def gateway_alive(self, gateway_id: str) -> bool:
        if not gateway_id:
            return False
        key = member_key(MemberInfo(MemberKind.GATEWAY, gateway_id))
        return await self.bus.kv_get(self.subjects.members_bucket, key) is not None

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_id: int,
        record: StreamRecord | None = None,
        *,
        tenant: str = "",
        retention_class: str = "",
    ) -> RequestStream:
        """Admit the request (raises SubmitRejected) and return the stream of its deltas.

        ``record`` (its ``start_seq`` from ``next_out_seq``) makes the stream resumable: it is
        stored while the submit is under way, long before a client could ask to resume.
        ``tenant`` and ``retention_class``: whose cached KV it may use, and how long its own is kept.
        """
        req = SubmitRequest(
            request_id,
            self.gateway_id,
            pack_tokens(prompt_token_ids),
            params,
            eos_token_id,
            tenant=tenant,
            retention_class=retention_class,
        )
        submit = self.bus.request(self.subjects.submit, encode(req), self.submit_timeout_s)
        # Registered before the submit goes out, so no output can arrive before its queue exists.
        pending = self._pending[request_id] = Pending(params.n, params.logprobs)
        try:
            if record is None:
                raw = await submit
            else:
                store = self.bus.kv_put(self.subjects.streams_bucket, request_id, encode(record))
                _, raw = await asyncio.gather(store, submit)
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
        # Only a resumable stream is worth keeping for a while once its client is gone.
        on_leave: OnLeave = "now" if record is None else "never" if record.background else "grace"
        return self._stream(request_id, pending, on_leave)

    def next_out_seq(self) -> int:
        """A start for a request submitted now: nothing of it can be in the out stream before it.

        One past the newest message this gateway has seen there (a lower bound, kept without a
        round trip; a replay skips the other requests' outputs in between)."""
        return self._out_seq_seen + 1

    async def stream_record(self, request_id: str) -> StreamRecord | None:
        raw = await self.bus.kv_get(self.subjects.streams_bucket, request_id)
        return None if raw is None else decode(StreamRecord, raw)

    async def replay(self, record: StreamRecord, on_leave: OnLeave = "grace") -> RequestStream:
        """The request's deltas again from the first, then live: for a client that reconnects.

        ``on_leave``: what a reader that leaves early does to the request ("never" for a
        background response, which is not the reader's to cancel)."""
        if record.start_seq < 1:
            raise ValueError(f"stream record of {record.request_id} has no start sequence")
        pending = Pending(record.n, record.logprobs)
        request_id = record.request_id

        async def on_message(msg: Message) -> None:
            try:
                step = decode(StepOutputs, msg.data)
            except DecodeError:
                return  # the live consumer logs it
            for out in step.outputs:
                if out.request_id == request_id:
                    pending.accept(out)

        sub = await self.bus.subscribe_durable(
            self.subjects.out(record.gateway_id), on_message, start_seq=record.start_seq
        )
        # Claimed once the replay runs: the gateway whose reader left must not cancel it now.
        await self.bus.publish(self.subjects.resume_claim, encode(ResumeClaim(request_id, self.gateway_id)))
        return self._stream(request_id, pending, on_leave, sub)

    def _stream(
        self, request_id: str, pending: Pending, on_leave: OnLeave, sub: Subscription | None = None
    ) -> RequestStream:
        """A reader of the request: a live one (``sub`` None: fed by this gateway's consumer) or a
        replay with its own subscription."""
        self._grace.joined(request_id, on_leave)

        def close(stream: RequestStream, failed: bool) -> None:
            if sub is None:
                self._pending.pop(request_id, None)
            else:
                self._spawn(sub.unsubscribe())
            self._grace.left(request_id, on_leave, stream.finished, failed)

        return RequestStream(request_id, pending, self.cancel_soon, close)

    async def _on_claim(self, msg: Message) -> None:
        try:
            claim = decode(ResumeClaim, msg.data)
        except DecodeError:
            return
        # A reader of ours joined already: its own claim has nothing to tell us.
        if claim.gateway_id != self.gateway_id and self._grace.claimed(claim.request_id):
            log.info("request %s resumed at %s: not cancelled", claim.request_id, claim.gateway_id)

    async def _on_stats(self, msg: Message) -> None:
        stats = decode_or_warn(KVCacheStats, msg.data, log, f"KV-cache stats on {msg.subject}")
        if stats is None:
            return
        self.kv_stats.update(stats, time.monotonic())

    def cancel_soon(self, request_id: str) -> None:
        """Publish a cancel without awaiting: safe from a cancelled task or a finally block."""
        self._spawn(self.bus.publish(self.subjects.cancel, encode(CancelRequest((request_id,)))))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _on_step_outputs(self, msg: Message) -> None:
        try:
            step = decode(StepOutputs, msg.data)
        except DecodeError as exc:
            log.error("undecodable step outputs at stream seq %d: %s", msg.seq, exc)
            return
        self._out_seq_seen = max(self._out_seq_seen, msg.seq)
        last = self._last_seq.get(step.scheduler_id)
        self._last_seq[step.scheduler_id] = step.seq
        if last is not None and step.seq != last + 1:
            self._fail_scheduler(step.scheduler_id, f"lost step outputs {last + 1}..{step.seq - 1}")
        for out in step.outputs:
            pending = self._pending.get(out.request_id)
            if pending is not None:  # else cancelled here already, or another gateway's with our id
                pending.accept(out)

    def _fail_scheduler(self, scheduler_id: str, why: str) -> None:
        log.error("scheduler %s: %s", scheduler_id, why)
        for pending in self._pending.values():
            if pending.scheduler_id == scheduler_id:
                pending.fail(why)
