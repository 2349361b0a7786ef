"""The scheduler service on the in-memory bus, with a scripted stand-in on the worker's subjects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from libs.bus.base import Message
from libs.bus.memory import InMemoryBus
from libs.protocol.codec import decode, encode, pack_tokens, unpack_tokens
from libs.protocol.messages import (
    CancelRequest,
    FinishReason,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
    StepOutputs,
    SubmitReply,
    SubmitRequest,
    SubmitStatus,
    WorkerLoad,
)
from libs.protocol.subjects import Subjects
from services.scheduler.config import Config
from services.scheduler.service import SchedulerService

SUBJECTS = Subjects()
EOS = 2


class ScriptedWorker:
    """Answers every step with token 100 + step id per sequence and records the plans."""

    def __init__(self, bus: InMemoryBus, worker_id: str = "w1", max_num_seqs: int = 4) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.max_num_seqs = max_num_seqs
        self.plans: list[SchedulerOutput] = []
        self.held: set[str] = set()
        self.gate = asyncio.Event()
        self.gate.set()

    async def start(self) -> None:
        await self.bus.subscribe(SUBJECTS.worker_step(self.worker_id), self.on_step)
        load = WorkerLoad(self.worker_id, 0, self.max_num_seqs, 64)
        await self.bus.publish(SUBJECTS.load(self.worker_id), encode(load))

    async def on_step(self, msg: Message) -> None:
        await self.gate.wait()
        plan = decode(SchedulerOutput, msg.data)
        self.plans.append(plan)
        self.held -= set(plan.finished_seq_ids)
        ids = tuple(s.seq_id for s in plan.new_seqs) + plan.decode_seq_ids
        self.held |= set(ids)
        tokens = [100 + plan.step_id] * len(ids)
        out = ModelRunnerOutput(plan.step_id, ids, pack_tokens(tokens), len(self.held))
        await self.bus.respond(msg, encode(out))


@pytest.fixture
async def stack() -> AsyncIterator[tuple[InMemoryBus, ScriptedWorker, asyncio.Queue[StepOutputs]]]:
    bus = InMemoryBus()
    stop = asyncio.Event()
    service = SchedulerService(Config(scheduler_id="s1", max_num_waiting=2), bus)
    task = asyncio.create_task(service.run(stop))
    await asyncio.sleep(0.01)
    worker = ScriptedWorker(bus)
    await worker.start()
    outputs: asyncio.Queue[StepOutputs] = asyncio.Queue()

    async def collect(msg: Message) -> None:
        outputs.put_nowait(decode(StepOutputs, msg.data))

    await bus.subscribe_durable(SUBJECTS.out("gw"), collect)
    await asyncio.sleep(0.01)
    yield bus, worker, outputs
    stop.set()
    await asyncio.wait_for(task, 5)
    await bus.close()


async def submit(bus: InMemoryBus, request_id: str, max_tokens: int = 3) -> SubmitReply:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    req = SubmitRequest(request_id, "gw", pack_tokens([5, 6, 7]), params, EOS)
    return decode(SubmitReply, await bus.request(SUBJECTS.submit, encode(req), 1))


async def test_tokens_flow_in_order_one_message_per_step(stack) -> None:  # type: ignore[no-untyped-def]
    bus, _worker, outputs = stack
    reply = await submit(bus, "r1", max_tokens=3)
    assert reply.status is SubmitStatus.ACCEPTED and reply.scheduler_id == "s1"
    got: list[int] = []
    seqs = []
    while True:
        step = await asyncio.wait_for(outputs.get(), 2)
        seqs.append(step.seq)
        (out,) = step.outputs
        got += unpack_tokens(out.new_token_ids)
        assert out.num_output_tokens == len(got) and out.num_prompt_tokens == 3
        if out.finish_reason is not None:
            break
    assert out.finish_reason is FinishReason.LENGTH
    assert got == [101, 102, 103] and seqs == [1, 2, 3]


async def test_cancel_reaches_the_worker_even_when_idle(stack) -> None:  # type: ignore[no-untyped-def]
    bus, worker, outputs = stack
    await submit(bus, "r1", max_tokens=1000)
    await asyncio.wait_for(outputs.get(), 2)
    worker.gate.clear()  # hold the worker so the cancel lands between steps
    await asyncio.sleep(0.01)
    await bus.publish(SUBJECTS.cancel, encode(CancelRequest(("r1",))))
    await asyncio.sleep(0.01)
    worker.gate.set()
    for _ in range(100):
        if "r1" not in worker.held:
            break
        await asyncio.sleep(0.01)
    assert "r1" not in worker.held
    assert any("r1" in p.finished_seq_ids for p in worker.plans)


async def test_admission_queue_full_and_no_workers() -> None:
    bus = InMemoryBus()
    stop = asyncio.Event()
    service = SchedulerService(Config(scheduler_id="s1", max_num_waiting=1), bus)
    task = asyncio.create_task(service.run(stop))
    await asyncio.sleep(0.01)
    assert (await submit(bus, "r0")).status is SubmitStatus.NO_WORKERS
    worker = ScriptedWorker(bus)
    worker.gate.clear()  # nothing leaves the queue while the worker is held
    await worker.start()
    await asyncio.sleep(0.01)
    statuses = [(await submit(bus, f"r{i}")).status for i in range(1, 8)]
    assert SubmitStatus.QUEUE_FULL in statuses
    stop.set()
    worker.gate.set()
    await asyncio.wait_for(task, 5)
    await bus.close()
