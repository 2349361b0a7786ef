"""The scheduler service on the in-memory bus, with a scripted stand-in on the worker's subjects."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import pytest

from deepinfer.settings import build_config
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
from tests.unit.scheduler.fake_worker import EOS, FakeWorker, reference_output

PROMPT = [5, 6, 7]

SUBJECTS = Subjects()
BLOCK_SIZE = 4


class ScriptedWorker:
    """A FakeWorker (hash "model", KV checks) on the worker's subjects; records plans."""

    def __init__(
        self, bus: InMemoryBus, worker_id: str = "w1", max_num_seqs: int = 4, owner: str = ""
    ) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.max_num_seqs = max_num_seqs
        self.owner = owner
        self.fake = FakeWorker(BLOCK_SIZE)
        self.plans: list[SchedulerOutput] = []
        self.gate = asyncio.Event()
        self.gate.set()

    @property
    def held(self) -> set[str]:
        return set(self.fake.seqs)

    async def start(self) -> None:
        await self.bus.subscribe(SUBJECTS.worker_step(self.worker_id), self.on_step)
        load = WorkerLoad(self.worker_id, 0, self.max_num_seqs, 64, 32, BLOCK_SIZE, owner=self.owner)
        await self.bus.publish(SUBJECTS.load(self.worker_id), encode(load))

    async def on_step(self, msg: Message) -> None:
        await self.gate.wait()
        plan = decode(SchedulerOutput, msg.data)
        self.plans.append(plan)
        ids, tokens = self.fake.execute(plan)
        out = ModelRunnerOutput(plan.step_id, ids, pack_tokens(tokens), len(self.fake.seqs))
        await self.bus.respond(msg, encode(out))


Stack = tuple[InMemoryBus, ScriptedWorker, asyncio.Queue[StepOutputs]]


@contextlib.asynccontextmanager
async def running(config: Config) -> AsyncIterator[Stack]:
    """A scheduler service with ``config`` on an in-memory bus, one scripted worker, and the
    step outputs published to gateway "gw"."""
    bus = InMemoryBus()
    stop = asyncio.Event()
    task = asyncio.create_task(SchedulerService(config, bus).run(stop))
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


@pytest.fixture(params=[True, False], ids=["overlap", "no-overlap"])
async def stack(request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    async with running(Config(scheduler_id="s1", max_num_waiting=4, overlap=request.param)) as parts:
        yield parts


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
    assert got == reference_output(PROMPT, 3, 64, ignore_eos=True)
    assert seqs == list(range(1, len(seqs) + 1))


async def test_choices_arrive_with_their_index(stack) -> None:  # type: ignore[no-untyped-def]
    bus, _worker, outputs = stack
    assert (await submit(bus, "r1", max_tokens=4, n=2)).status is SubmitStatus.ACCEPTED
    got: dict[int, list[int]] = {0: [], 1: []}
    finished: set[int] = set()
    while len(finished) < 2:
        step = await asyncio.wait_for(outputs.get(), 2)
        for out in step.outputs:
            assert out.request_id == "r1"
            got[out.index] += unpack_tokens(out.new_token_ids)
            assert out.num_output_tokens == len(got[out.index])
            if out.finish_reason is not None:
                finished.add(out.index)
    assert got[0] == got[1] == reference_output(PROMPT, 4, 64, ignore_eos=True)


async def test_cached_prompt_tokens_are_reported_per_tenant(stack) -> None:  # type: ignore[no-untyped-def]
    bus, _worker, outputs = stack
    prompt = list(range(20, 30))  # two full blocks of 4, then the last token's block

    async def cached_tokens(request_id: str, tenant: str) -> int:
        assert (await submit(bus, request_id, prompt=prompt, tenant=tenant)).status is SubmitStatus.ACCEPTED
        got: list[int] = []
        while True:
            (out,) = (await asyncio.wait_for(outputs.get(), 2)).outputs
            got += unpack_tokens(out.new_token_ids)
            if out.finish_reason is not None:
                assert got == reference_output(prompt, 3, 64, ignore_eos=True)
                return out.num_cached_tokens

    assert await cached_tokens("r1", "acme") == 0
    assert await cached_tokens("r2", "acme") == 8
    assert await cached_tokens("r3", "globex") == 0


async def test_prefix_caching_can_be_switched_off() -> None:
    config = build_config(Config, argparse.Namespace(), {"DEEPINFER_ENABLE_PREFIX_CACHING": "false"})
    assert not config.enable_prefix_caching
    async with running(dataclasses.replace(config, scheduler_id="s1")) as (bus, worker, outputs):
        prompt = list(range(20, 30))
        for request_id in ("r1", "r2"):
            assert (await submit(bus, request_id, prompt=prompt)).status is SubmitStatus.ACCEPTED
            while True:
                (out,) = (await asyncio.wait_for(outputs.get(), 2)).outputs
                assert out.num_cached_tokens == 0
                if out.finish_reason is not None:
                    break
        assert all(new.num_computed_tokens == 0 for plan in worker.plans for new in plan.new_seqs)


async def test_the_worker_is_claimed_with_an_empty_plan(stack) -> None:  # type: ignore[no-untyped-def]
    _bus, worker, _outputs = stack
    first = worker.plans[0]
    assert first.scheduler_id == "s1" and first.num_scheduled_seqs == 0


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
    # and the end goes out to the gateway like any finish, so a replayed stream ends too
    total = 0
    while True:
        (out,) = (await asyncio.wait_for(outputs.get(), 2)).outputs
        total += len(unpack_tokens(out.new_token_ids))
        assert out.num_output_tokens == total + 1  # the first step's token was read above
        if out.finish_reason is not None:
            break
    assert out.finish_reason is FinishReason.ABORT


async def test_a_worker_owned_by_another_scheduler_is_left_alone() -> None:
    bus = InMemoryBus()
    stop = asyncio.Event()
    task = asyncio.create_task(SchedulerService(Config(scheduler_id="s1"), bus).run(stop))
    await asyncio.sleep(0.01)
    worker = ScriptedWorker(bus, owner="s2")
    await worker.start()
    await asyncio.sleep(0.01)
    assert (await submit(bus, "r0")).status is SubmitStatus.NO_WORKERS
    assert worker.plans == []
    stop.set()
    await asyncio.wait_for(task, 5)
    await bus.close()


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
