"""Adapts bus messages to the scheduler's fleet: one WorkerScheduler core and one StepLoop per
owned worker, under one request table (``Fleet``).

submit (request/reply: the queue group, or this replica's own subject when the gateway's KV router
picked one of its workers) -> ``Placement`` (G3 lookup, then that worker or one by cached prefix
against load, or a prefill worker for a long uncached prompt) -> the worker's core; each worker's
StepLoop runs plan = core.schedule(); result = worker.step(plan); core.postprocess(result), and
this service publishes one StepOutputs per destination gateway per step into the durable OUT
stream (``OutputPublisher``). KVSync keeps each core's view of its worker's host memory (G2)
current from the workers' KV events; ``DeviceEvents`` publishes each core's G1 for the routers.
A prefilled request is handed to a decode worker (``Handoffs``).

A worker serves one scheduler at a time (block tables are the scheduler's, so two schedulers
would hand out the same KV pages): a scheduler claims a free worker with an empty plan when it
sees it, unless another live replica drives fewer workers (that one gets a few seconds to claim
it first), and leaves alone workers whose load report names another owner.

A worker is lost when a probe of a slow step finds nothing subscribed to its steps, when its
heartbeat in the members bucket stops for ``worker_timeout_s`` or says it is stuck in a step, or
when another scheduler takes it: its requests move to other workers (``Fleet.lose_worker``), and
fail only where none can take them. Every worker is dropped, its requests failed, when the bus
connection is lost (steps in flight may be gone); a load report afterwards claims it again with a
fresh core. A worker whose load says ``draining`` gets no new requests and its requests move now.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from libs.bus.base import Bus, Message
from libs.bus.membership import MembershipView, announce
from libs.protocol.codec import DecodeError, decode, decode_or_warn, encode
from libs.protocol.member_messages import MemberInfo, MemberKind, WorkerLoad
from libs.protocol.messages import CancelRequest, PauseRequest, SubmitReply, SubmitRequest, SubmitStatus
from libs.protocol.subjects import QUEUE_SCHEDULERS, Subjects
from libs.runtime.logs import request_scope, set_request_id
from libs.runtime.tracing import parent_context, tracer
from services.scheduler import metrics
from services.scheduler.config import Config
from services.scheduler.device_events import DeviceEvents
from services.scheduler.fleet import NO_TARGET, Fleet, Moves, WorkerLoss
from services.scheduler.handoff import Handoffs
from services.scheduler.kv_sync import KVSync
from services.scheduler.outputs import OutputPublisher
from services.scheduler.pausing import ResumedBy
from services.scheduler.placement import Placement
from services.scheduler.sequence import Sequence
from services.scheduler.step_loop import StepLoop, WorkerHandle, WorkerLost
from services.scheduler.worker_scheduler import Limits, WorkerScheduler

log = logging.getLogger(__name__)

CLAIM_DEFER_S = 3.0  # a free worker is left this long to a replica driving fewer workers


class SchedulerService:
    def __init__(self, config: Config, bus: Bus) -> None:
        self.config = config
        self.bus = bus
        self.subjects = Subjects(config.subject_prefix)
        self.workers: dict[str, WorkerHandle] = {}
        self.fleet = Fleet(config.migration_limit)  # the request table and the workers' cores
        self._foreign: set[str] = set()  # workers owned by another scheduler
        self._free_since: dict[str, float] = {}  # free workers left to a replica with fewer
        self.outputs = OutputPublisher(bus, self.subjects, config.scheduler_id)
        self._tasks: asyncio.TaskGroup | None = None
        self.kv = KVSync(config, bus, self.workers)
        self.device_events = DeviceEvents(bus, self.subjects, config.scheduler_id, self.workers)
        self.placement = Placement(config, self.workers, self.fleet, self.kv, self.outputs)
        self.handoffs = Handoffs(self.fleet, self.kv, self.workers, config.handoff_timeout_s, self._moved)
        self.kv.on_store_written = self.handoffs.written
        self._readers = ResumedBy(config.pause_timeout_s)  # stale pauses (a reader moved gateway)
        # Workers are dropped when their heartbeat stops or says they are stuck in a step.
        self.members = MembershipView(bus, self.subjects.members_bucket, silence_s=config.worker_timeout_s)

    async def run(self, stop: asyncio.Event) -> None:
        await self.bus.ensure_stream(
            self.subjects.out_stream, [self.subjects.out_all], self.config.out_max_age_s
        )
        async with asyncio.TaskGroup() as tg:
            self._tasks = tg  # before the subscriptions: their handlers start tasks in it
            subs = [
                await self.bus.subscribe(self.subjects.submit, self.on_submit, queue=QUEUE_SCHEDULERS),
                await self.bus.subscribe(self.subjects.submit_to(self.config.scheduler_id), self.on_submit),
                await self.bus.subscribe(self.subjects.cancel, self.on_cancel),
                await self.bus.subscribe(self.subjects.pause, self.on_pause),
                await self.bus.subscribe(self.subjects.load_all, self.on_load),
                await self.bus.subscribe(self.subjects.kv_events, self.kv.on_kv_events),
                await self.bus.subscribe(
                    self.subjects.kv_dump(self.config.scheduler_id), self.device_events.on_dump
                ),
            ]
            log.info("scheduler %s ready", self.config.scheduler_id)
            tg.create_task(announce(self.bus, self.subjects.members_bucket, self.member_info, stop))
            tg.create_task(self.members.watch(stop, self._check_workers))
            self.bus.add_connection_listener(self._on_connection)
            tg.create_task(self.kv.publish_stats(stop))
            tg.create_task(self.device_events.publish(stop, self.config.kv_events_interval_s))
            tg.create_task(self._expire_paused(stop))
            await stop.wait()
            for sub in subs:
                await sub.unsubscribe()
            for handle in list(self.workers.values()):
                self._drop_worker(
                    handle,
                    "scheduler stopping",
                    f"scheduler {self.config.scheduler_id} stopping",
                    WorkerLoss.UNREACHABLE,
                )

    def member_info(self) -> MemberInfo:
        """The heartbeat: with what this scheduler has sent each gateway, so that one whose last
        outputs were lost (and nothing came after them) notices, and how many workers it drives."""
        out_seqs = self.outputs.out_seqs()
        scheduler_id = self.config.scheduler_id
        return MemberInfo(
            MemberKind.SCHEDULER,
            scheduler_id,
            out_seqs=out_seqs,
            num_workers=len(self.workers),
            incarnation=self.outputs.incarnation,
        )

    # --- inbound messages ------------------------------------------------------------------

    async def on_submit(self, msg: Message) -> None:
        try:
            req = decode(SubmitRequest, msg.data)
        except DecodeError as exc:
            await self.bus.respond(msg, encode(SubmitReply(SubmitStatus.INVALID, str(exc))))
            return
        assert self._tasks is not None, "subscribed before running"
        # The G3 lookup may take up to kv_lookup_timeout_s: other submits do not queue behind it.
        self._tasks.create_task(self._answer_submit(msg, req))

    async def _answer_submit(self, msg: Message, req: SubmitRequest) -> None:
        set_request_id(req.request_id)  # this task's log lines are about this request
        attributes = {"deepinfer.request_id": req.request_id}
        parent = parent_context(req.traceparent)
        with tracer().start_as_current_span("scheduler.place", context=parent, attributes=attributes) as span:
            try:
                reply = await self.admit(req)
                span.set_attribute("deepinfer.submit_status", reply.status.name.lower())
                await self.bus.respond(msg, encode(reply))
            except Exception:  # one failed submit must not take the service's TaskGroup down with it
                log.exception("submit %s failed", req.request_id)

    async def admit(self, req: SubmitRequest) -> SubmitReply:
        return await self.placement.admit(req)

    async def on_cancel(self, msg: Message) -> None:
        """Ids are request ids (every choice) or sequence ids (one choice)."""
        cancel = decode_or_warn(CancelRequest, msg.data, log, "cancel")
        if cancel is None:
            return
        for request_id in cancel.request_ids:
            worker_id, aborted = self.fleet.cancel(request_id)
            if aborted:
                if worker_id in self.workers:  # (a request in transit is on no worker)
                    self.workers[worker_id].wake.set()  # the next plan tells the worker to drop it
                # The end goes out like any other: a reader replaying the stream sees it end.
                self._publish_soon(aborted, "")
                with request_scope(request_id):
                    log.info("cancelled %s", request_id)

    async def on_pause(self, msg: Message) -> None:
        """Pause requests whose stream lost its client (their sequences leave the worker at once),
        or resume them (a reader came back: they are queued again)."""
        pause = decode_or_warn(PauseRequest, msg.data, log, "pause")
        if pause is None:
            return
        now = time.monotonic()
        deadline = now + (pause.timeout_s or self.config.pause_timeout_s)
        for request_id in pause.request_ids:
            with request_scope(request_id):
                self._pause_one(request_id, pause, deadline, now)

    def _pause_one(self, request_id: str, pause: PauseRequest, deadline: float, now: float) -> None:
        if not self._readers.admit(request_id, pause.gateway_id, pause.resume, now):
            log.info("ignored a stale pause of %s from %s", request_id, pause.gateway_id)
            return
        worker_id, changed = self.fleet.pause(request_id, deadline, pause.resume)
        if changed and worker_id in self.workers:
            self.workers[worker_id].wake.set()  # the next plan drops it there, or admits it again
            log.info("%s %s", "resumed" if pause.resume else "paused", request_id)

    async def _expire_paused(self, stop: asyncio.Event) -> None:
        """Cancel paused requests that nobody resumed or cancelled in time (their gateway may be gone)."""
        while not stop.is_set():
            expired = self.fleet.expire_paused(time.monotonic())
            if expired:
                self._publish_soon(expired, "")  # a reader replaying the stream sees it end
                log.warning("cancelled %d sequences paused past their deadline", len(expired))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)  # deadlines are met within a second

    async def on_load(self, msg: Message) -> None:
        load = decode_or_warn(WorkerLoad, msg.data, log, "load message")
        if load is None:
            return
        handle = self.workers.get(load.worker_id)
        if load.owner not in ("", self.config.scheduler_id):
            if handle is not None:
                metrics.WORKER_LOSSES.labels("taken").inc()
                self._drop_worker(handle, f"taken by scheduler {load.owner}", loss=WorkerLoss.LEFT)
            if load.worker_id not in self._foreign:
                log.info("worker %s belongs to scheduler %s", load.worker_id, load.owner)
            self._foreign.add(load.worker_id)
            self._free_since.pop(load.worker_id, None)  # free again later: a fresh wait
            return
        self._foreign.discard(load.worker_id)
        info = self.members.get(MemberKind.WORKER, load.worker_id)
        stuck = info is not None and info.stuck  # a stuck one waits for its step
        if handle is None and not stuck and not load.draining:  # a draining one is left to leave
            if not self._defers_claim(load.worker_id):
                self._add_worker(load)
        elif handle is not None:
            handle.load = load
            handle.last_seen = time.monotonic()
            if load.draining and self.fleet.table.num_requests_on(load.worker_id):
                self._drain(handle)

    # --- workers ---------------------------------------------------------------------------

    def _defers_claim(self, worker_id: str) -> bool:
        """Replicas share the free workers: one that drives more workers than another live
        replica leaves a free worker to it for ``CLAIM_DEFER_S`` (then claims it anyway: the other
        may be unable to)."""
        now = time.monotonic()
        others = [
            m.num_workers
            for m in self.members.live(MemberKind.SCHEDULER)
            if m.member_id != self.config.scheduler_id and m.num_workers >= 0
        ]
        if not others or len(self.workers) <= min(others):
            self._free_since.pop(worker_id, None)
            return False
        since = self._free_since.setdefault(worker_id, now)
        if now - since < CLAIM_DEFER_S:
            return True
        del self._free_since[worker_id]
        return False

    def _add_worker(self, load: WorkerLoad) -> None:
        if self._tasks is None:
            return  # not running yet
        limits = Limits(
            num_blocks=load.num_kv_blocks,
            block_size=load.block_size,
            max_num_seqs=load.max_num_seqs,
            max_model_len=load.max_model_len,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_waiting=self.config.max_num_waiting,
            enable_prefix_caching=self.config.enable_prefix_caching,
            enable_kv_tiers=self.config.enable_kv_tiers,
            speculative_method=self.config.speculative_method,
            num_speculative_tokens=self.config.num_speculative_tokens,
            speculative_policy=self.config.speculative_policy,
        )
        core = WorkerScheduler(limits, self.config.scheduler_id, load.model_fingerprint or load.model)
        core.record_step_profile(load.step_profile)
        handle = WorkerHandle(load, core, time.monotonic())
        self.workers[load.worker_id] = handle
        self.fleet.add_worker(load.worker_id, core, load.role)
        handle.task = self._tasks.create_task(self._drive(handle))
        log.info(
            "worker %s joined (max_num_seqs=%d, %d KV blocks of %d)",
            load.worker_id,
            load.max_num_seqs,
            load.num_kv_blocks,
            load.block_size,
        )
        for worker_id in list(self.fleet.draining):  # what could not move off a draining worker
            if worker_id in self.workers and self.fleet.table.num_requests_on(worker_id):
                self._drain(self.workers[worker_id])

    async def _drive(self, handle: WorkerHandle) -> None:
        loop = StepLoop(
            self.bus,
            self.subjects.worker_step(handle.load.worker_id),
            handle,
            self.config.overlap,
            self.config.step_timeout_s,
            self._publish,
        )
        # Dropped handles leave the loop by this check too: on Python 3.11 a cancel that races with
        # a reply arriving inside asyncio.wait_for can be swallowed.
        try:
            await loop.claim()
            await loop.run(lambda: self.workers.get(handle.load.worker_id) is handle)
        except WorkerLost as exc:
            if self.workers.get(handle.load.worker_id) is handle:
                log.error("worker %s: %s", handle.load.worker_id, exc)
                metrics.WORKER_LOSSES.labels("step_failed").inc()
                self._drop_worker(handle, str(exc))

    def _drop_worker(
        self, handle: WorkerHandle, why: str, error: str = "", loss: WorkerLoss = WorkerLoss.CRASHED
    ) -> None:
        """Move the worker's requests to others (see Fleet); those that cannot move fail with
        ``error`` (default: the worker is lost, ``why``) and, beyond having no target, why not."""
        worker_id = handle.load.worker_id
        if self.workers.get(worker_id) is not handle:
            return
        del self.workers[worker_id]
        handle.wake.set()
        if handle.task is not None:
            handle.task.cancel()
        if handle.load.draining and loss is WorkerLoss.CRASHED:
            loss = WorkerLoss.LEFT  # it left with what could not move in its drain timeout
        # Not onto a worker whose heartbeat stopped too (a crash can find another one SIGSTOPped,
        # or stalled, that the next check of the members drops with what it was just given).
        avoid = [w for w in self.workers if self.members.silent(MemberKind.WORKER, w)]
        moves = self.fleet.lose_worker(worker_id, loss, avoid)
        self.kv.retire(handle.core)
        self._wake_targets(moves)
        if moves.moved:
            num_moved = sum(len(s) for s in moves.moved.values())
            metrics.MIGRATIONS.labels(loss.name.lower()).inc(num_moved)
            log.warning("worker %s lost (%s): moved %d sequences", worker_id, why, num_moved)
        if moves.failed:
            base = error or f"worker {worker_id} lost: {why}"
            for seq, reason in moves.failed:
                seq.error = base if reason == NO_TARGET else f"{base} (not moved: {reason})"
            log.warning("worker %s lost (%s): failing %d sequences", worker_id, why, len(moves.failed))
            self._publish_soon([seq for seq, _ in moves.failed], base)

    def _drain(self, handle: WorkerHandle) -> None:
        """A worker going away: move what it holds to other workers now."""
        moves = self.fleet.drain(handle.load.worker_id)
        handle.wake.set()  # its next plan drops what moved
        self._wake_targets(moves)
        num_moved = sum(len(s) for s in moves.moved.values())
        if num_moved:
            metrics.MIGRATIONS.labels("drain").inc(num_moved)
            log.info("worker %s drains: moved %d sequences", handle.load.worker_id, num_moved)

    def _wake_targets(self, moves: Moves) -> None:
        for target in moves.moved:
            self.workers[target].wake.set()

    async def _publish(self, seqs: list[Sequence], error: str = "") -> None:
        """Every step's output goes out here: finished sequences leave the request table first,
        and prefilled ones start their handoff (after their first token is taken for publishing)."""
        self.fleet.finished(seqs)
        if self._tasks is not None:
            for request_id in self.handoffs.ready(seqs):
                self._tasks.create_task(self.handoffs.hand_off(request_id))
        await self.outputs.publish(seqs, error)

    def _moved(self, moves: Moves, error: str) -> None:
        """After a handoff: wake the target; a request with no target fails with ``error``."""
        self._wake_targets(moves)
        for seq, reason in moves.failed:
            seq.error = f"{error}: {reason}"
        if moves.failed:
            self._publish_soon([seq for seq, _ in moves.failed], error)

    def _publish_soon(self, seqs: list[Sequence], error: str) -> None:
        self.fleet.finished(seqs)  # now, not when the task runs: the table follows the cores
        if self._tasks is not None:
            self._tasks.create_task(self.outputs.publish(seqs, error))

    def _check_workers(self) -> None:
        """After each read of the members: drop workers whose heartbeat stopped or that are stuck.

        A worker is judged only while the view is current, and not in its first moments (its
        load report may come before its first heartbeat is read)."""
        if not self.members.current:
            return  # cut off from the bus: nothing is known, the connection listener acts
        now = time.monotonic()
        for worker_id, handle in list(self.workers.items()):
            info = self.members.get(MemberKind.WORKER, worker_id)
            if info is None and now - handle.last_seen > self.config.worker_timeout_s:
                metrics.WORKER_LOSSES.labels("silent").inc()
                self._drop_worker(handle, "no heartbeat")
            elif info is not None and info.stuck:
                metrics.WORKER_LOSSES.labels("stuck").inc()
                self._drop_worker(handle, f"stuck in a step for {info.step_s:.0f} s")

    def _on_connection(self, connected: bool) -> None:
        """Step requests and replies in flight across a lost connection may be gone: every worker
        is dropped (its requests failed) and claimed again from its next load report."""
        if connected:
            return
        for handle in list(self.workers.values()):
            metrics.WORKER_LOSSES.labels("connection_lost").inc()
            self._drop_worker(
                handle,
                "NATS connection lost",
                "NATS connection lost: the step outputs in flight are gone",
                WorkerLoss.UNREACHABLE,
            )
