"""Drives one worker: plan -> step request -> result -> postprocess, keeping plans in flight.

With overlap on, up to two plans are in flight: while the worker computes plan N, plan N+1 is
already made and queued at the worker, so the bus round trip, the scheduler's bookkeeping and the
publishing of N's tokens all happen while the model runs. The worker executes plans in the order
it receives them and feeds its own sampled tokens into the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from libs.bus.base import Bus, NoResponders, RequestTimeout
from libs.kvstore.event_cursor import EventCursor
from libs.protocol.codec import DecodeError, decode, encode, unpack_tokens
from libs.protocol.member_messages import WorkerLoad
from libs.protocol.messages import ModelRunnerOutput, SchedulerOutput
from services.scheduler import metrics
from services.scheduler.sequence import Sequence
from services.scheduler.worker_scheduler import WorkerScheduler

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # an empty plan with nothing in flight re-checks this often (never expected)
# A step reply slower than this: is the worker still subscribed? An empty request on its step
# subject answers at once while a step runs; "no responders" means its process is gone (kill -9
# closes its connection, and NATS drops its subscriptions), seconds before its heartbeat says so.
PROBE_AFTER_S = 1.0
PROBE_TIMEOUT_S = 1.0


class WorkerLost(Exception):
    """The worker failed a step or stopped answering; every sequence on it is lost."""


@dataclass(eq=False)
class WorkerHandle:
    load: WorkerLoad
    core: WorkerScheduler
    last_seen: float
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    kv_cursor: EventCursor = field(default_factory=EventCursor)  # its KV events applied so far
    task: asyncio.Task[None] | None = None


class StepLoop:
    def __init__(
        self,
        bus: Bus,
        subject: str,
        handle: WorkerHandle,
        overlap: bool,
        step_timeout_s: float,
        publish: Callable[[list[Sequence]], Awaitable[None]],
    ) -> None:
        self.bus = bus
        self.subject = subject
        self.handle = handle
        self.max_in_flight = 2 if overlap else 1
        self.step_timeout_s = step_timeout_s
        self.publish = publish
        self._in_flight: deque[asyncio.Task[bytes]] = deque()

    async def claim(self) -> None:
        """An empty plan: the worker takes this scheduler as its owner, or says who owns it."""
        plan = self.handle.core.schedule()
        await self._finish_step(asyncio.ensure_future(self._send(plan)))

    async def run(self, alive: Callable[[], bool]) -> None:
        core = self.handle.core
        try:
            while alive():
                num_preemptions = core.num_preemptions
                plan = core.next_plan(len(self._in_flight), self.max_in_flight)
                metrics.PREEMPTIONS.inc(core.num_preemptions - num_preemptions)
                if plan is not None:
                    new_seq_ids = (s.seq_id for s in plan.new_seqs)
                    metrics.observe_queue_times(core.seqs, new_seq_ids, time.monotonic())
                    self._in_flight.append(asyncio.ensure_future(self._send(plan)))
                    continue
                if self._in_flight:
                    await self._finish_step(self._in_flight.popleft())
                    continue
                self.handle.wake.clear()
                if core.has_work():  # nothing runnable until something changes; should not happen
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.handle.wake.wait(), IDLE_POLL_S)
                else:
                    await self.handle.wake.wait()
        finally:
            for task in self._in_flight:
                task.cancel()

    async def _send(self, plan: SchedulerOutput) -> bytes:
        sent = time.perf_counter()
        reply = await self.bus.request(self.subject, encode(plan), self.step_timeout_s)
        metrics.STEP_SECONDS.observe(time.perf_counter() - sent)  # answered steps only
        return reply

    async def _reply(self, task: asyncio.Future[bytes]) -> bytes:
        """The step's reply; WorkerLost as soon as a probe finds nothing subscribed to its steps."""
        while True:
            done, _ = await asyncio.wait({task}, timeout=PROBE_AFTER_S)
            if done:
                return task.result()
            try:
                await self.bus.request(self.subject, b"", PROBE_TIMEOUT_S)
            except NoResponders as exc:
                task.cancel()
                raise WorkerLost("gone: nothing answers on its step subject") from exc
            except Exception:  # busy, stopped (SIGSTOP) or a slow bus: its heartbeat decides
                continue

    async def _finish_step(self, task: asyncio.Future[bytes]) -> None:
        try:
            result = decode(ModelRunnerOutput, await self._reply(task))
        except (NoResponders, RequestTimeout, DecodeError) as exc:
            raise WorkerLost(f"step failed: {exc!r}") from exc
        if result.error:
            raise WorkerLost(result.error)
        core = self.handle.core
        failed_loads = dict(zip(result.failed_load_seq_ids, result.failed_load_num_blocks, strict=True))
        num_host, num_store = result.num_loaded_host_blocks, result.num_loaded_store_blocks
        core.record_loads(result.step_id, num_host, num_store, failed_loads)
        core.kv_tiers.record_partial_loads(result.num_loaded_partial_blocks, result.num_failed_partial_blocks)
        metrics.STEPS.inc()
        core.record_step_time(result.step_id, result.forward_time_s)
        failed = dict(zip(result.failed_seq_ids, result.failed_errors, strict=True))
        metrics.count_failed(failed.values())
        num_sampled = unpack_tokens(result.num_sampled_tokens) if result.num_sampled_tokens else None
        sampled = unpack_tokens(result.sampled_token_ids)
        changed = core.postprocess(
            result.seq_ids, sampled, result.logprobs, failed, num_sampled, result.drafts()
        )
        if changed:
            await self.publish(changed)
