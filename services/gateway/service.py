"""The gateway's bus side: submit/cancel, and one consumer that demuxes step outputs to requests.

All step outputs for this gateway arrive on one ordered JetStream consumer (subject
``out.<gateway_id>``), never one per request. Two checks make a loss loud instead of silent: each
scheduler numbers its messages to this gateway (a gap fails that scheduler's requests), and each
output carries its choice's running token count (a mismatch fails that choice).

A request with n > 1 is one submit; the scheduler runs choice i as sequence
``seq_id_of(request_id, i)`` and tags its outputs with ``index`` i. The request is over when every
choice is: finished by the scheduler, or stopped here (a stop string cancels just that sequence).

Liveness: a watcher keeps a view of the members bucket. The requests of a scheduler gone from it
(``scheduler_watch``), and those a scheduler hands back, move to another with the tokens received
so far (``migration``). A lost bus connection fails every request in flight, naming NATS.
``ready()`` (/health) reads only that view and the connection state, never the bus.

Resume: at admission a ``StreamRecord`` goes into the streams bucket (where the outputs will be in
the out stream, how to render them, and what it takes to move the request). A client that went
away leaves its request paused (it computes nothing, its KV stays cached) for ``resume_grace_s``;
a reconnect, here or at any gateway, replays the out stream from the record, claims the request
(``ResumeClaim``), so the cancel never comes and the claimer moves it from then on, and resumes it
(a ``PauseRequest`` with ``resume``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Coroutine
from typing import Any

from libs.bus.base import Bus, Message, NoResponders, RequestTimeout, Subscription
from libs.bus.membership import MEMBER_TTL_S, MembershipView, member_key
from libs.protocol.codec import DecodeError, decode, decode_or_warn, encode, pack_tokens
from libs.protocol.kv_messages import KVCacheStats
from libs.protocol.member_messages import MemberInfo, MemberKind
from libs.protocol.messages import (
    CancelRequest,
    ImageSpan,
    PauseRequest,
    RequestOutput,
    SamplingParams,
    SchedulerRef,
    StepOutputs,
    SubmitReply,
    SubmitRequest,
    SubmitStatus,
)
from libs.protocol.stream_messages import ResumeClaim, StreamRecord
from libs.protocol.subjects import Subjects
from services.gateway.economics import DeviceClock
from services.gateway.fleet_metrics import StatsBoard
from services.gateway.grace import GracePeriods, OnLeave
from services.gateway.kv_router import KVRouter
from services.gateway.migration import Migrations
from services.gateway.out_numbering import OutNumbering
from services.gateway.request_stream import Pending, RequestStream
from services.gateway.routing import RouterFeed
from services.gateway.scheduler_watch import SchedulerWatch
from services.gateway.submit_path import send_submit

log = logging.getLogger(__name__)


class SubmitRejected(Exception):
    def __init__(self, status: SubmitStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class GatewayService:
    """``resume_grace_s``: how long a request outlives its client's disconnect (0: cancel at once).
    ``migration_limit``: how often a request may move to another scheduler after its own was lost;
    ``resubmit_window_s``: how long a move may look for a scheduler that takes it."""

    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        gateway_id: str,
        submit_timeout_s: float,
        resume_grace_s: float = 0.0,
        out_max_age_s: float = 600.0,
        migration_limit: int = 3,
        resubmit_window_s: float = 10.0,
        router: KVRouter | None = None,
    ) -> None:
        self.bus = bus
        self.subjects = subjects
        self.gateway_id = gateway_id
        self.submit_timeout_s = submit_timeout_s
        self.out_max_age_s = out_max_age_s
        self.migrations = Migrations(
            bus,
            subjects,
            lambda: self.schedulers.live(),
            submit_timeout_s,
            migration_limit,
            resubmit_window_s,
            self._spawn,
            self._moved,
        )
        # None: a submit goes to any scheduler (the queue group), which places it itself
        self.router = None if router is None else RouterFeed(bus, subjects, router)
        self._pending: dict[str, Pending] = {}
        self.numbering = OutNumbering(gateway_id)
        self._background: set[asyncio.Task[None]] = set()
        self._grace = GracePeriods(resume_grace_s, self.cancel_soon, self.pause_soon)
        self._out_seq_seen = 0  # the newest out stream sequence this gateway has seen
        self.kv_stats = StatsBoard()  # every service's latest KV-cache stats, for /metrics
        self.device_clock = DeviceClock()  # live workers' time, for the serving economics
        # Kept current by a background watcher: /health and the failing of requests whose
        # scheduler died read it without a round trip.
        self.members = MembershipView(bus, subjects.members_bucket)
        self._replays: set[Pending] = set()
        self.schedulers = SchedulerWatch(
            self.members, self.numbering, self.migrations, self._pending, self._replays
        )
        self._stop = asyncio.Event()

    async def start(self) -> None:
        subjects = self.subjects
        await self.bus.ensure_stream(subjects.out_stream, [subjects.out_all], self.out_max_age_s)
        await self.bus.ensure_kv(subjects.streams_bucket, self.out_max_age_s)
        await self.bus.ensure_kv(subjects.members_bucket, MEMBER_TTL_S)
        await self.bus.subscribe(subjects.resume_claim, self._on_claim)
        await self.bus.subscribe(subjects.stats_all, self._on_stats)
        if self.router is not None:
            await self.router.start()
        self._out_seq_seen = await self.bus.stream_last_seq(subjects.out_stream)
        await self.bus.subscribe_durable(subjects.out(self.gateway_id), self._on_step_outputs)
        self.bus.add_connection_listener(self._on_connection)
        await self.members.refresh()
        self._on_members()
        self._spawn(self.members.watch(self._stop, self._on_members))

    async def close(self) -> None:
        self._stop.set()

    @property
    def num_in_flight(self) -> int:
        """Requests read here now: live ones and resumed ones."""
        return len(self._pending) + len(self._replays)

    def ready(self) -> bool:
        """Whether a request can be served now: connected to the bus, and a live scheduler with a
        live worker it may use, not stuck in a step (from the watched members: no round trip)."""
        return self.bus.connected and self.members.can_serve()

    async def healthy(self) -> bool:
        return self.ready()

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
        prediction_token_ids: list[int] | None = None,
        priority: int = 0,
        tenant_weight: float = 1.0,
        traceparent: str = "",
        image_spans: tuple[ImageSpan, ...] = (),
    ) -> RequestStream:
        """Admit the request (raises SubmitRejected) and return the stream of its deltas.

        ``record`` (its ``start_seq`` from ``next_out_seq``) makes the stream resumable: it is
        stored while the submit is under way, long before a client could ask to resume.
        ``tenant`` and ``retention_class``: whose cached KV it may use, and how long its own is kept.
        ``prediction_token_ids``: the output the client predicts (drafted from; Predicted Outputs).
        ``priority``: its place among waiting requests (lower runs first; the API key's);
        ``tenant_weight``: its tenant's share of admissions (the key's); ``traceparent``: its trace;
        ``image_spans``: where the prompt's images sit (encoded already).
        """
        req = SubmitRequest(
            request_id,
            self.gateway_id,
            pack_tokens(prompt_token_ids),
            params,
            eos_token_id,
            priority=priority,
            tenant=tenant,
            tenant_weight=tenant_weight,
            retention_class=retention_class,
            prediction_token_ids=pack_tokens(prediction_token_ids or []),
            traceparent=traceparent,
            image_spans=image_spans,
        )
        schedulers = functools.partial(self.members.live, MemberKind.SCHEDULER)
        submit = send_submit(
            self.bus, self.subjects, req, prompt_token_ids, self.router, schedulers, self.submit_timeout_s
        )
        record = None if record is None else dataclasses.replace(record, submit=req)
        # Registered before the submit goes out, so no output can arrive before its queue exists.
        pending = Pending(params.n, params.logprobs, submit=req, request_id=request_id, record=record)
        self._pending[request_id] = pending
        reply = await self._submitted(request_id, submit, record)
        if reply.status is not SubmitStatus.ACCEPTED:
            self._pending.pop(request_id, None)
            raise SubmitRejected(reply.status, reply.message)
        self._taken(pending, reply)
        # Only a resumable stream is worth keeping for a while once its client is gone.
        on_leave: OnLeave = "now" if record is None else "never" if record.background else "grace"
        pending.on_leave = on_leave
        return self._stream(request_id, pending, on_leave)

    async def _submitted(
        self, request_id: str, submit: Awaitable[SubmitReply], record: StreamRecord | None
    ) -> SubmitReply:
        """The scheduler's reply to a submit (its record stored meanwhile); a failed submit is
        unregistered, and one that may have been admitted is cancelled."""
        try:
            if record is None:
                return await submit
            store = self.bus.kv_put(self.subjects.streams_bucket, request_id, encode(record))
            _, reply = await asyncio.gather(store, submit)
            return reply
        except NoResponders as exc:
            self._pending.pop(request_id, None)
            raise SubmitRejected(SubmitStatus.NO_WORKERS, "no scheduler is available") from exc
        except BaseException as exc:  # timed out or cancelled: the scheduler may have admitted it
            self._pending.pop(request_id, None)
            self.cancel_soon(request_id)
            if isinstance(exc, RequestTimeout):  # (one killed a moment ago, say): a 503 with why
                why = f"the scheduler did not answer within {self.submit_timeout_s:g} s"
                raise SubmitRejected(SubmitStatus.NO_WORKERS, why) from exc
            raise

    def _taken(self, pending: Pending, reply: SubmitReply) -> None:
        """A scheduler accepted the request (a submit, or a resubmit after a loss or hand-back)."""
        assert pending.submit is not None
        if pending.submit.gateway_id == self.gateway_id:  # (a replay's outputs go elsewhere)
            self.numbering.accepted(reply.scheduler, reply.out_seq)
        self.migrations.taken(pending, reply.scheduler)

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
        request_id, subject = record.request_id, self.subjects.out(record.gateway_id)
        pending = Pending.replaying(record, time.monotonic())
        # It moves nothing before it has read what the out stream held at its start.
        last_seq = await self.bus.stream_last_seq(self.subjects.out_stream, subject)
        pending.caught_up = last_seq < record.start_seq

        async def on_message(msg: Message) -> None:
            try:
                step = decode(StepOutputs, msg.data)
            except DecodeError:
                return  # the live consumer logs it
            outputs = [out for out in step.outputs if out.request_id == request_id]
            self._deliver_all(step.scheduler, [(pending, out) for out in outputs])
            pending.caught_up = pending.caught_up or msg.seq >= last_seq

        self._replays.add(pending)
        if record.submit is not None:  # before its first output: a hand-back there is this one's
            self.migrations.movers[request_id] = pending
        sub = await self.bus.subscribe_durable(subject, on_message, start_seq=record.start_seq)
        # Claimed once the replay runs: the gateway whose reader left must not cancel it now, nor
        # move it: this reader does (it has the submit). And resumed from here too, for when that
        # gateway is gone (a request resumed twice just runs).
        await self.bus.publish(self.subjects.resume_claim, encode(ResumeClaim(request_id, self.gateway_id)))
        self.pause_soon(request_id, resume=True)  # with this gateway's id: a stale pause loses to it
        return self._stream(request_id, pending, on_leave, sub)

    def _stream(
        self, request_id: str, pending: Pending, on_leave: OnLeave, sub: Subscription | None = None
    ) -> RequestStream:
        """A reader of the request: a live one (``sub`` None: fed by this gateway's consumer) or a
        replay with its own subscription."""
        self._grace.joined(request_id, on_leave)

        def close(stream: RequestStream, failed: bool) -> None:
            self.migrations.release(pending)
            if sub is None:
                self._pending.pop(request_id, None)
            else:
                self._replays.discard(pending)
                self._spawn(sub.unsubscribe())
            self._grace.left(request_id, on_leave, stream.finished, failed)

        return RequestStream(request_id, pending, self.cancel_soon, close)

    async def _on_claim(self, msg: Message) -> None:
        try:
            claim = decode(ResumeClaim, msg.data)
        except DecodeError:
            return
        if claim.gateway_id == self.gateway_id:
            return  # a reader of ours joined already: its own claim has nothing to tell us
        self.migrations.claimed(claim.request_id)
        if self._grace.claimed(claim.request_id):
            log.info("request %s resumed at %s: not cancelled", claim.request_id, claim.gateway_id)

    async def _on_stats(self, msg: Message) -> None:
        stats = decode_or_warn(KVCacheStats, msg.data, log, f"KV-cache stats on {msg.subject}")
        if stats is None:
            return
        self.kv_stats.update(stats, time.monotonic())

    def cancel_soon(self, request_id: str) -> None:
        """Publish a cancel without awaiting: safe from a cancelled task or a finally block."""
        self._spawn(self.bus.publish(self.subjects.cancel, encode(CancelRequest((request_id,)))))

    def pause_soon(self, request_id: str, resume: bool) -> None:
        """Publish a pause (or, ``resume``, its end) without awaiting. A pause left alone is
        cancelled by the scheduler after twice the grace period, should this gateway not be there
        to cancel it after one."""
        pause = PauseRequest((request_id,), resume, 2 * self._grace.grace_s, self.gateway_id)
        self._spawn(self.bus.publish(self.subjects.pause, encode(pause)))

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
        gap = self.numbering.arrived(step.scheduler, step.seq)
        if gap:
            self.schedulers.fail(step.scheduler, gap)
        # (a request not pending: cancelled here already, or another gateway's with our id)
        outputs = [
            (self._pending[out.request_id], out) for out in step.outputs if out.request_id in self._pending
        ]
        self._deliver_all(step.scheduler, outputs)

    def _deliver_all(self, scheduler: SchedulerRef, outputs: list[tuple[Pending, RequestOutput]]) -> None:
        """Hand one step's outputs to their readers; then move what that scheduler handed back."""
        handed_back: dict[str, tuple[Pending, RequestOutput]] = {}
        for pending, out in outputs:
            fresh = pending.deliver(scheduler, out)
            # (a move under way goes on: its tries look again where the request can go)
            if fresh and not pending.moving and self.migrations.handed_back(pending, out):
                handed_back[pending.request_id] = (pending, out)
        for pending, out in handed_back.values():
            self.migrations.start(pending, out.error, avoid=scheduler)

    def _on_members(self) -> None:
        """After each read of the members: the device clock, then the lost schedulers' requests."""
        self.observe_devices()
        if self.members.current:  # (cut off from the bus: the connection listener acts)
            self.schedulers.on_members()

    def observe_devices(self) -> None:
        """Bring the device clock up to now (every members read, and every scrape)."""
        live = self.members.live(MemberKind.WORKER) if self.members.current else None
        workers = None if live is None else {m.member_id: m.device or "unknown" for m in live}
        self.device_clock.observe(time.monotonic(), workers)

    def _moved(self, pending: Pending, reply: SubmitReply) -> None:
        """A scheduler took a moved request (its record says so, whoever reads it now)."""
        self._taken(pending, reply)
        request_id, num_moves = pending.request_id, pending.num_moves
        log.warning("request %s moved to scheduler %s (move %d)", request_id, reply.scheduler_id, num_moves)
        # Its reader left meanwhile: what that did (cancel, pause) reached no scheduler holding it.
        if pending.reader_left and pending.on_leave == "now":
            self.cancel_soon(request_id)
        elif pending.reader_left and pending.on_leave == "grace":
            self.pause_soon(request_id, resume=False)

    def _on_connection(self, connected: bool) -> None:
        """Step outputs published while this gateway was cut off never arrive: every request in
        flight fails at once; sequence numbers start afresh with the next output."""
        # The first output of each scheduler after the outage starts its numbering afresh: also
        # at the reconnect, for outputs read before the loss but handled after its news.
        self.numbering.clear()
        if connected:
            self._spawn(self._refresh_members())
            return
        readers = [*self._pending.values(), *self._replays]
        if readers:
            log.error("lost the connection to NATS: failing %d requests", len(readers))
        for pending in readers:
            pending.fail("NATS connection lost: the step outputs in flight are gone")
        self.migrations.movers.clear()

    async def _refresh_members(self) -> None:
        await self.members.refresh()
        self._on_members()
