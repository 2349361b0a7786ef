"""Adapts bus messages to the ModelRunner: step request -> forward in a thread -> reply + load."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from libs.bus.base import Bus, Message
from libs.bus.membership import announce
from libs.protocol.codec import DecodeError, decode, encode
from libs.protocol.messages import MemberInfo, MemberKind, ModelRunnerOutput, SchedulerOutput, WorkerLoad
from libs.protocol.subjects import Subjects
from services.worker.config import Config
from services.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)


class WorkerService:
    def __init__(
        self, config: Config, bus: Bus, runner: ModelRunner, max_model_len: int, model_name: str
    ) -> None:
        self.config = config
        self.bus = bus
        self.runner = runner
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.subjects = Subjects(config.subject_prefix)
        self._last_step_ms = 0.0
        self._last_plan_at: dict[str, float] = {}  # scheduler id -> when its last step ended
        self._stepping = asyncio.Lock()  # orphan checks never run while a step holds the runner

    async def run(self, stop: asyncio.Event) -> None:
        sub = await self.bus.subscribe(self.subjects.worker_step(self.config.worker_id), self.on_step)
        info = MemberInfo(MemberKind.WORKER, self.config.worker_id, model=self.model_name)
        log.info("worker %s ready (max_num_seqs=%d)", self.config.worker_id, self.config.max_num_seqs)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(announce(self.bus, self.subjects.members_bucket, info, stop))
            tg.create_task(self._report_load(stop))
            await stop.wait()
            await sub.unsubscribe()

    async def on_step(self, msg: Message) -> None:
        try:
            plan = decode(SchedulerOutput, msg.data)
        except DecodeError as exc:
            await self.bus.respond(msg, encode(ModelRunnerOutput(0, (), b"", 0, error=str(exc))))
            return
        start = time.perf_counter()
        async with self._stepping:
            try:
                # The forward runs off the event loop so load reports and other messages keep flowing.
                result = await asyncio.to_thread(self.runner.execute, plan)
            except Exception as exc:
                log.exception("step %d failed", plan.step_id)
                self.runner.reset()  # the scheduler fails every request it had here
                result = ModelRunnerOutput(
                    plan.step_id, (), b"", self.runner.num_running_seqs, error=repr(exc)
                )
            self._last_plan_at[plan.scheduler_id] = time.monotonic()
        self._last_step_ms = (time.perf_counter() - start) * 1e3
        await self.bus.respond(msg, encode(result))
        await self._publish_load()

    def load(self) -> WorkerLoad:
        return WorkerLoad(
            worker_id=self.config.worker_id,
            num_running_seqs=self.runner.num_running_seqs,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            step_time_ms=self._last_step_ms,
            model=self.model_name,
        )

    async def _publish_load(self) -> None:
        await self.bus.publish(self.subjects.load(self.config.worker_id), encode(self.load()))

    async def drop_orphans(self) -> int:
        """Free the sequences of schedulers silent for ``orphan_timeout_s``.

        A scheduler with sequences here sends steps back to back, so such silence means it died
        (or lost this worker); its sequences would otherwise hold KV pages forever.
        """
        async with self._stepping:
            now = time.monotonic()
            num_freed = 0
            for scheduler_id in self.runner.schedulers():
                if now - self._last_plan_at.get(scheduler_id, now) > self.config.orphan_timeout_s:
                    num_freed += self.runner.free_owned_by(scheduler_id)
                    log.warning("scheduler %r went silent: dropped its sequences", scheduler_id)
            return num_freed

    async def _report_load(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.drop_orphans()
            await self._publish_load()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.load_interval_s)
