"""The scheduler service on the in-memory bus, with a scripted stand-in on the worker's subjects:
the harness of the scheduler service tests (test_scheduler_service.py, test_scheduler_kv.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from libs.bus.base import Message
from libs.bus.memory import InMemoryBus
from libs.protocol.codec import decode, encode, pack_tokens
from libs.protocol.member_messages import StepSample, WorkerLoad
from libs.protocol.messages import SamplingParams, SchedulerOutput, StepOutputs, SubmitReply, SubmitRequest
from libs.protocol.subjects import Subjects
from services.scheduler.config import Config
from services.scheduler.service import SchedulerService
from tests.unit.scheduler.fake_worker import EOS, FakeRunner

PROMPT = [5, 6, 7]

SUBJECTS = Subjects()
BLOCK_SIZE = 4


class ScriptedWorker:
    """A FakeWorker (hash "model", KV checks) on the worker's subjects; records plans."""

    def __init__(
        self,
        bus: InMemoryBus,
        worker_id: str = "w1",
        max_num_seqs: int = 4,
        owner: str = "",
        has_kv_store: bool = True,
        step_profile: tuple[StepSample, ...] = (),
    ) -> None:
        self.bus = bus
        self.has_kv_store = has_kv_store
        self.step_profile = step_profile
        self.worker_id = worker_id
        self.max_num_seqs = max_num_seqs
        self.owner = owner
        self.runner = FakeRunner(BLOCK_SIZE)  # the ModelRunner interface over a FakeWorker
        self.fake = self.runner.worker
        self.plans: list[SchedulerOutput] = []
        self.gate = asyncio.Event()
        self.gate.set()

    @property
    def held(self) -> set[str]:
        return set(self.fake.seqs)

    async def start(self) -> None:
        self.subscription = await self.bus.subscribe(SUBJECTS.worker_step(self.worker_id), self.on_step)
        await self.publish_load()

    async def publish_load(self) -> None:
        load = WorkerLoad(self.worker_id, 0, self.max_num_seqs, 64, 32, BLOCK_SIZE, owner=self.owner)
        load = dataclasses.replace(load, has_kv_store=self.has_kv_store, step_profile=self.step_profile)
        await self.bus.publish(SUBJECTS.load(self.worker_id), encode(load))

    async def on_step(self, msg: Message) -> None:
        if not msg.data:  # a liveness probe, answered at once as the real worker does
            await self.bus.respond(msg, b"")
            return
        await self.gate.wait()
        plan = decode(SchedulerOutput, msg.data)
        self.plans.append(plan)
        await self.bus.respond(msg, encode(self.runner.execute(plan)))


Stack = tuple[InMemoryBus, ScriptedWorker, asyncio.Queue[StepOutputs]]


@contextlib.asynccontextmanager
async def running(config: Config) -> AsyncIterator[Stack]:
    """A scheduler service with ``config`` on an in-memory bus, one scripted worker, and the
    step outputs published to gateway "gw"."""
    async with running_service(config) as (_service, *stack):
        yield stack[0], stack[1], stack[2]


@contextlib.asynccontextmanager
async def running_service(
    config: Config,
) -> AsyncIterator[tuple[SchedulerService, InMemoryBus, ScriptedWorker, asyncio.Queue[StepOutputs]]]:
    bus = InMemoryBus()
    stop = asyncio.Event()
    service = SchedulerService(config, bus)
    task = asyncio.create_task(service.run(stop))
    await asyncio.sleep(0.01)
    worker = ScriptedWorker(bus)
    await worker.start()
    outputs: asyncio.Queue[StepOutputs] = asyncio.Queue()

    async def collect(msg: Message) -> None:
        outputs.put_nowait(decode(StepOutputs, msg.data))

    await bus.subscribe_durable(SUBJECTS.out("gw"), collect)
    await asyncio.sleep(0.01)
    yield service, bus, worker, outputs
    stop.set()
    await asyncio.wait_for(task, 5)
    await bus.close()


async def submit(
    bus: InMemoryBus,
    request_id: str,
    max_tokens: int = 3,
    n: int = 1,
    prompt: list[int] = PROMPT,
    tenant: str = "",
) -> SubmitReply:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)
    req = SubmitRequest(request_id, "gw", pack_tokens(prompt), params, EOS, tenant=tenant)
    return decode(SubmitReply, await bus.request(SUBJECTS.submit, encode(req), 1))
