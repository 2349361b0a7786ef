"""The worker service on the in-memory bus with a tiny random-weight model: steps, load, ownership."""

from __future__ import annotations

import asyncio

import torch

from libs.bus.base import Message
from libs.bus.memory import InMemoryBus
from libs.models.llama import LlamaForCausalLM
from libs.protocol.codec import decode, encode, pack_tokens
from libs.protocol.messages import ModelRunnerOutput, NewSequence, SamplingParams, SchedulerOutput, WorkerLoad
from libs.protocol.subjects import Subjects
from services.worker.config import Config
from services.worker.model_runner import ModelRunner, ModelShape
from services.worker.service import WorkerService
from tests.tiny_models import TINY_LLAMA

SUBJECTS = Subjects()


def make_service(bus: InMemoryBus, orphan_timeout_s: float) -> WorkerService:
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY_LLAMA).eval()
    runner = ModelRunner(model, ModelShape.of(TINY_LLAMA), 16, 4, torch.float32)
    config = Config(worker_id="w1", orphan_timeout_s=orphan_timeout_s, load_interval_s=3600)
    return WorkerService(config, bus, runner, max_model_len=64, model_name="tiny")


def plan(step_id: int, scheduler_id: str, seq_id: str, block: int) -> bytes:
    params = SamplingParams(temperature=0.0)
    new = NewSequence(seq_id, pack_tokens([3, 4, 5]), b"", params, (2,), pack_tokens([block]), 0, 3)
    return encode(SchedulerOutput(step_id, (new,), scheduler_id=scheduler_id))


async def step(bus: InMemoryBus, data: bytes) -> ModelRunnerOutput:
    return decode(ModelRunnerOutput, await bus.request(SUBJECTS.worker_step("w1"), data, 5))


async def test_owner_steps_others_are_refused_and_a_silent_owner_is_released() -> None:
    bus = InMemoryBus()
    service = make_service(bus, orphan_timeout_s=0.2)
    loads: list[WorkerLoad] = []

    async def on_load(msg: Message) -> None:
        loads.append(decode(WorkerLoad, msg.data))

    await bus.subscribe(SUBJECTS.load("w1"), on_load)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await asyncio.sleep(0.01)
    out = await step(bus, plan(1, "s1", "a", block=0))
    assert out.seq_ids == ("a",) and out.num_running_seqs == 1 and not out.error
    assert loads[-1].owner == "s1" and loads[-1].num_kv_blocks == 16 and loads[-1].block_size == 4
    refused = await step(bus, plan(1, "s2", "b", block=1))
    assert "owned by scheduler s1" in refused.error and set(service.runner.seqs) == {"a"}
    assert await service.drop_orphans() == 0  # s1 just spoke
    await asyncio.sleep(0.3)  # s1 is now silent for longer than the timeout while holding "a"
    assert await service.drop_orphans() == 1
    assert service.owner == "" and service.runner.seqs == {}
    out = await step(bus, plan(1, "s2", "b", block=1))
    assert out.seq_ids == ("b",) and service.owner == "s2"
    service.runner.check_integrity()
    bad = await bus.request(SUBJECTS.worker_step("w1"), b"\x00garbage", 5)
    assert decode(ModelRunnerOutput, bad).error
    stop.set()
    await asyncio.wait_for(task, 5)
    await bus.close()
