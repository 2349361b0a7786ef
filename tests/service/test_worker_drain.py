"""A worker told to stop drains, on the in-memory bus with a tiny random-weight model: it says
``draining`` in its load and heartbeat and keeps serving its owner's plans until it holds nothing,
its drain timeout passes, the stop is hurried, or its owner is gone; one holding nothing leaves at
once."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import torch

from libs.bus.base import Message
from libs.bus.membership import announce, member_key
from libs.bus.memory import InMemoryBus
from libs.models.llama import LlamaForCausalLM
from libs.protocol.codec import decode, encode, pack_tokens
from libs.protocol.member_messages import MemberInfo, MemberKind, WorkerLoad
from libs.protocol.messages import SchedulerOutput
from libs.protocol.subjects import Subjects
from libs.runtime.process import StopEvent
from services.worker.config import Config
from services.worker.model_runner import ModelRunner, ModelShape
from services.worker.service import WorkerService
from tests.service.test_worker_service import plan, step
from tests.tiny_models import TINY_LLAMA

SUBJECTS = Subjects()
BUCKET = SUBJECTS.members_bucket
WORKER_KEY = member_key(MemberInfo(MemberKind.WORKER, "w1"))


def make_service(bus: InMemoryBus, drain_timeout_s: float, load_interval_s: float = 3600) -> WorkerService:
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY_LLAMA).eval()
    runner = ModelRunner(model, ModelShape.of(TINY_LLAMA), 16, 4, torch.float32)
    config = Config(
        worker_id="w1", drain_timeout_s=drain_timeout_s, load_interval_s=load_interval_s, orphan_timeout_s=30
    )
    return WorkerService(config, bus, runner, max_model_len=64, model_name="tiny")


def decode_plan(step_id: int, seq_id: str) -> bytes:
    """One decode token for ``seq_id``, within the block it has."""
    plan = SchedulerOutput(
        step_id,
        seq_ids=(seq_id,),
        num_scheduled_tokens=pack_tokens([1]),
        new_block_ids=(pack_tokens([]),),
        scheduler_id="s1",
    )
    return encode(plan)


async def until(condition: Callable[[], bool], timeout_s: float = 5) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def member_entry(bus: InMemoryBus) -> MemberInfo | None:
    raw = (await bus.kv_items(BUCKET)).get(WORKER_KEY)
    return None if raw is None else decode(MemberInfo, raw)


async def start(bus: InMemoryBus, service: WorkerService) -> tuple[StopEvent, asyncio.Task[None]]:
    """The worker running, with scheduler s1 as a live member holding sequence "a" on it."""
    stop = StopEvent()
    task = asyncio.create_task(service.run(stop))
    await asyncio.sleep(0.01)
    out = await step(bus, plan(1, "s1", "a", block=0))
    assert out.seq_ids == ("a",) and not out.error and service.owner == "s1"
    return stop, task


async def test_a_draining_worker_serves_its_owner_until_a_plan_drops_what_it_holds() -> None:
    bus = InMemoryBus()
    service = make_service(bus, drain_timeout_s=30)
    loads: list[WorkerLoad] = []

    async def on_load(msg: Message) -> None:
        loads.append(decode(WorkerLoad, msg.data))

    await bus.subscribe(SUBJECTS.load("w1"), on_load)
    owner_stop = asyncio.Event()
    owner = asyncio.create_task(announce(bus, BUCKET, MemberInfo(MemberKind.SCHEDULER, "s1"), owner_stop))
    stop, task = await start(bus, service)
    assert not loads[-1].draining
    num_loads = len(loads)
    stop.on_signal(signal.SIGTERM)
    # Said at once (the periodic report is an hour away here), and in the heartbeat's next refresh.
    await until(lambda: len(loads) > num_loads)
    assert loads[-1].draining and loads[-1].num_running_seqs == 1
    async with asyncio.timeout(5):
        while (entry := await member_entry(bus)) is None or not entry.draining:
            await asyncio.sleep(0.05)
    out = await step(bus, decode_plan(2, "a"))  # still subscribed: the owner's plans are served
    assert out.seq_ids == ("a",) and not out.error and out.num_running_seqs == 1
    await asyncio.sleep(0.2)
    assert not task.done() and not stop.hurried.is_set()
    out = await step(bus, encode(SchedulerOutput(3, finished_seq_ids=("a",), scheduler_id="s1")))
    assert not out.error and out.num_running_seqs == 0
    await asyncio.wait_for(task, 5)  # nothing held: it leaves, well before its 30 s
    assert await member_entry(bus) is None  # a clean leave
    assert service.runner.seqs == {}
    owner_stop.set()
    await owner
    await bus.close()


async def test_the_drain_timeout_ends_a_drain_that_keeps_sequences() -> None:
    bus = InMemoryBus()
    service = make_service(bus, drain_timeout_s=0.5)
    owner_stop = asyncio.Event()
    owner = asyncio.create_task(announce(bus, BUCKET, MemberInfo(MemberKind.SCHEDULER, "s1"), owner_stop))
    stop, task = await start(bus, service)
    stop.on_signal(signal.SIGTERM)
    await asyncio.sleep(0.2)
    assert not task.done()  # "a" is still held and the owner is alive
    await asyncio.wait_for(task, 5)
    assert set(service.runner.seqs) == {"a"} and await member_entry(bus) is None
    owner_stop.set()
    await owner
    await bus.close()


async def test_a_second_signal_cuts_the_drain_short() -> None:
    bus = InMemoryBus()
    service = make_service(bus, drain_timeout_s=30)
    owner_stop = asyncio.Event()
    owner = asyncio.create_task(announce(bus, BUCKET, MemberInfo(MemberKind.SCHEDULER, "s1"), owner_stop))
    stop, task = await start(bus, service)
    stop.on_signal(signal.SIGTERM)
    await asyncio.sleep(0.2)
    assert not task.done()
    stop.on_signal(signal.SIGTERM)  # hurried
    await asyncio.wait_for(task, 2)
    assert set(service.runner.seqs) == {"a"}
    owner_stop.set()
    await owner
    await bus.close()


async def test_a_drain_ends_soon_after_its_owner_is_gone() -> None:
    bus = InMemoryBus()
    # Load reports (and their orphan checks) every 0.1 s; the owner never joins the members bucket,
    # like one that stopped and removed its entry. A drain waiting for a whole member TTL twice over
    # (12 s), or for the orphan timeout (30 s), fails the wait below.
    service = make_service(bus, drain_timeout_s=30, load_interval_s=0.1)
    stop, task = await start(bus, service)
    stop.on_signal(signal.SIGTERM)
    await asyncio.wait_for(task, 5)
    assert service.runner.seqs == {} and service.owner == ""
    service.runner.check_integrity()
    await bus.close()


async def test_a_worker_holding_nothing_leaves_at_once() -> None:
    bus = InMemoryBus()
    service = make_service(bus, drain_timeout_s=30)
    stop = StopEvent()
    task = asyncio.create_task(service.run(stop))
    await asyncio.sleep(0.01)
    assert await member_entry(bus) is not None
    stop.on_signal(signal.SIGTERM)
    await asyncio.wait_for(task, 2)
    assert service.draining and await member_entry(bus) is None
    await bus.close()
