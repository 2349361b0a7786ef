"""Adapts bus messages to scheduler cores: one Scheduler core and one step loop per live worker.

submit (request/reply, queue group) -> route -> core.add; each worker's loop runs
plan = core.schedule(); result = worker.step(plan); core.postprocess(result), and publishes one
StepOutputs per destination gateway per step into the durable OUT stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

from libs.bus.base import Bus, Message, NoResponders, RequestTimeout
from libs.bus.membership import announce
from libs.protocol.codec import DecodeError, decode, encode, pack_tokens, unpack_tokens
from libs.protocol.errors import QueueFull
from libs.protocol.messages import (
    CancelRequest,
    FinishReason,
    MemberInfo,
    MemberKind,
    ModelRunnerOutput,
    RequestOutput,
    StepOutputs,
    SubmitReply,
    SubmitRequest,
    SubmitStatus,
    WorkerLoad,
)
from libs.protocol.subjects import QUEUE_SCHEDULERS, Subjects
from services.scheduler.config import Config
from services.scheduler.router import WorkerState, pick_worker
from services.scheduler.scheduler import Scheduler
from services.scheduler.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(eq=False)
class WorkerHandle:
    load: WorkerLoad
    core: Scheduler
    last_seen: float
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class SchedulerService:
    def __init__(self, config: Config, bus: Bus) -> None:
        self.config = config
        self.bus = bus
        self.subjects = Subjects(config.subject_prefix)
        self.workers: dict[str, WorkerHandle] = {}
        self._owner: dict[str, str] = {}  # request id -> worker id
        self._out_seq: dict[str, int] = defaultdict(int)  # gateway id -> last StepOutputs.seq
        self._tasks: asyncio.TaskGroup | None = None

    async def run(self, stop: asyncio.Event) -> None:
        await self.bus.ensure_stream(
            self.subjects.out_stream, [self.subjects.out_all], self.config.out_max_age_s
        )
        subs = [
            await self.bus.subscribe(self.subjects.submit, self.on_submit, queue=QUEUE_SCHEDULERS),
            await self.bus.subscribe(self.subjects.cancel, self.on_cancel),
            await self.bus.subscribe(self.subjects.load_all, self.on_load),
        ]
        info = MemberInfo(MemberKind.SCHEDULER, self.config.scheduler_id)
        log.info("scheduler %s ready", self.config.scheduler_id)
        async with asyncio.TaskGroup() as tg:
            self._tasks = tg
            tg.create_task(announce(self.bus, self.subjects.members_bucket, info, stop))
            tg.create_task(self._reap_dead_workers(stop))
            await stop.wait()
            for sub in subs:
                await sub.unsubscribe()
            for handle in list(self.workers.values()):
                self._drop_worker(handle, "scheduler stopping")

    # --- inbound messages ------------------------------------------------------------------

    async def on_submit(self, msg: Message) -> None:
        try:
            req = decode(SubmitRequest, msg.data)
        except DecodeError as exc:
            await self.bus.respond(msg, encode(SubmitReply(SubmitStatus.INVALID, str(exc))))
            return
        reply = self.admit(req)
        await self.bus.respond(msg, encode(reply))

    def admit(self, req: SubmitRequest) -> SubmitReply:
        states = [WorkerState(wid, len(h.core.seqs), h.load.max_num_seqs) for wid, h in self.workers.items()]
        worker_id = pick_worker(states)
        if worker_id is None:
            return SubmitReply(SubmitStatus.NO_WORKERS, "no worker is available")
        handle = self.workers[worker_id]
        prompt = unpack_tokens(req.prompt_token_ids)
        if len(prompt) + 1 > handle.core.max_model_len:
            return SubmitReply(SubmitStatus.INVALID, f"prompt of {len(prompt)} tokens exceeds the context")
        seq = Sequence(
            req.request_id,
            req.gateway_id,
            prompt,
            req.sampling_params,
            req.eos_token_id,
            priority=req.priority,
        )
        try:
            handle.core.add(seq)
        except QueueFull as exc:
            return SubmitReply(SubmitStatus.QUEUE_FULL, str(exc))
        self._owner[req.request_id] = worker_id
        handle.wake.set()
        return SubmitReply(SubmitStatus.ACCEPTED, scheduler_id=self.config.scheduler_id)

    async def on_cancel(self, msg: Message) -> None:
        try:
            cancel = decode(CancelRequest, msg.data)
        except DecodeError as exc:
            log.warning("bad cancel: %s", exc)
            return
        for request_id in cancel.request_ids:
            worker_id = self._owner.pop(request_id, None)
            handle = self.workers.get(worker_id) if worker_id else None
            if handle is not None and handle.core.abort(request_id) is not None:
                handle.wake.set()  # the next plan tells the worker to drop it
                log.info("cancelled %s", request_id)

    async def on_load(self, msg: Message) -> None:
        try:
            load = decode(WorkerLoad, msg.data)
        except DecodeError as exc:
            log.warning("bad load message: %s", exc)
            return
        handle = self.workers.get(load.worker_id)
        if handle is None:
            self._add_worker(load)
        else:
            handle.load = load
            handle.last_seen = time.monotonic()

    # --- workers ---------------------------------------------------------------------------

    def _add_worker(self, load: WorkerLoad) -> None:
        if self._tasks is None:
            return  # not running yet
        core = Scheduler(
            load.max_num_seqs, load.max_model_len, self.config.max_num_waiting, self.config.scheduler_id
        )
        handle = WorkerHandle(load, core, time.monotonic())
        self.workers[load.worker_id] = handle
        handle.task = self._tasks.create_task(self._step_loop(handle))
        log.info("worker %s joined (max_num_seqs=%d)", load.worker_id, load.max_num_seqs)

    def _drop_worker(self, handle: WorkerHandle, why: str) -> None:
        self.workers.pop(handle.load.worker_id, None)
        handle.wake.set()
        if handle.task is not None:
            handle.task.cancel()
        failed = handle.core.fail_all()
        for seq in failed:
            self._owner.pop(seq.seq_id, None)
        if failed:
            log.warning("worker %s lost (%s): failing %d requests", handle.load.worker_id, why, len(failed))
            self._publish_soon(failed, error=f"worker lost: {why}")

    def _publish_soon(self, seqs: list[Sequence], error: str) -> None:
        if self._tasks is not None:
            self._tasks.create_task(self._publish(seqs, error))

    async def _reap_dead_workers(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            now = time.monotonic()
            for handle in list(self.workers.values()):
                if now - handle.last_seen > self.config.worker_timeout_s:
                    self._drop_worker(handle, "no load report")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.worker_timeout_s / 4)

    async def _step_loop(self, handle: WorkerHandle) -> None:
        subject = self.subjects.worker_step(handle.load.worker_id)
        core = handle.core
        # Dropped handles leave the loop by this check too: on Python 3.11 a cancel that races with
        # a reply arriving inside asyncio.wait_for can be swallowed.
        while self.workers.get(handle.load.worker_id) is handle:
            if not core.has_work():
                handle.wake.clear()
                await handle.wake.wait()
                continue
            plan = core.schedule()
            try:
                reply = await self.bus.request(subject, encode(plan), self.config.step_timeout_s)
                result = decode(ModelRunnerOutput, reply)
            except (NoResponders, RequestTimeout, DecodeError) as exc:
                self._drop_worker(handle, f"step failed: {exc!r}")
                return
            if result.error:
                log.error("worker %s step %d failed: %s", handle.load.worker_id, plan.step_id, result.error)
                self._drop_worker(handle, result.error)
                return
            if result.failed_seq_ids:
                failed = core.fail(result.failed_seq_ids)
                await self._publish(failed, error="KV cache full")
                for seq in failed:
                    self._owner.pop(seq.seq_id, None)
            changed = core.postprocess(result.seq_ids, unpack_tokens(result.sampled_token_ids))
            for seq in changed:
                if seq.is_finished:
                    self._owner.pop(seq.seq_id, None)
            await self._publish(changed)

    # --- outputs ---------------------------------------------------------------------------

    async def _publish(self, seqs: list[Sequence], error: str = "") -> None:
        """One StepOutputs per destination gateway, carrying each sequence's new tokens."""
        by_gateway: dict[str, list[RequestOutput]] = defaultdict(list)
        for seq in seqs:
            new_tokens = seq.output_token_ids[seq.num_sent_tokens :]
            seq.num_sent_tokens = seq.num_output_tokens
            by_gateway[seq.gateway_id].append(
                RequestOutput(
                    request_id=seq.seq_id,
                    new_token_ids=pack_tokens(new_tokens),
                    num_output_tokens=seq.num_output_tokens,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    finish_reason=seq.finish_reason if seq.is_finished else None,
                    error=error if seq.finish_reason is FinishReason.ERROR else "",
                )
            )
        for gateway_id, outputs in by_gateway.items():
            self._out_seq[gateway_id] += 1
            step = StepOutputs(self.config.scheduler_id, self._out_seq[gateway_id], tuple(outputs))
            try:
                await self.bus.publish_durable(self.subjects.out(gateway_id), encode(step))
            except Exception as exc:  # the gateway sees the seq gap and fails these requests loudly
                log.error("publishing to gateway %s failed: %s", gateway_id, exc)
