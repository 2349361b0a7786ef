"""The worker service on the in-memory bus with a tiny random-weight model: steps, load, orphans."""

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
from services.worker.model_runner import KVLayout, ModelRunner
from services.worker.service import WorkerService
from tests.tiny_models import TINY_LLAMA

SUBJECTS = Subjects()


def make_service(bus: InMemoryBus, orphan_timeout_s: float) -> WorkerService:
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY_LLAMA).eval()
    layout = KVLayout(TINY_LLAMA.num_hidden_layers, TINY_LLAMA.num_key_value_heads, TINY_LLAMA.head_dim)
    runner = ModelRunner(model, layout, num_blocks=16, block_size=4, dtype=torch.float32)
    config = Config(worker_id="w1", orphan_timeout_s=orphan_timeout_s, load_interval_s=3600)
    return WorkerService(config, bus, runner, max_model_len=64, model_name="tiny")


def plan(step_id: int, scheduler_id: str, seq_id: str) -> bytes:
    new = (NewSequence(seq_id, pack_tokens([3, 4, 5]), SamplingParams(temperature=0.0)),)
    return encode(SchedulerOutput(step_id, new, scheduler_id=scheduler_id))


async def test_step_reply_load_and_orphaned_sequences_are_dropped() -> None:
    bus = InMemoryBus()
    service = make_service(bus, orphan_timeout_s=0.2)
    loads: list[WorkerLoad] = []

    async def on_load(msg: Message) -> None:
        loads.append(decode(WorkerLoad, msg.data))

    await bus.subscribe(SUBJECTS.load("w1"), on_load)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await asyncio.sleep(0.01)
    out = decode(ModelRunnerOutput, await bus.request(SUBJECTS.worker_step("w1"), plan(1, "dead", "a"), 5))
    assert out.seq_ids == ("a",) and out.num_running_seqs == 1 and not out.error
    await asyncio.sleep(0.3)  # "dead" now silent for longer than the timeout
    await bus.request(SUBJECTS.worker_step("w1"), plan(1, "live", "b"), 5)
    assert await service.drop_orphans() == 1
    assert set(service.runner.seqs) == {"b"}
    assert await service.drop_orphans() == 0  # "live" just spoke
    service.runner.check_integrity()
    assert loads[-1].num_running_seqs == 2  # published right after the last step
    bad = await bus.request(SUBJECTS.worker_step("w1"), b"\x00garbage", 5)
    assert decode(ModelRunnerOutput, bad).error
    stop.set()
    await asyncio.wait_for(task, 5)
    await bus.close()
