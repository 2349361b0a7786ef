"""The scheduler service on the in-memory bus, with a scripted stand-in on the worker's subjects:
token flow, choices, cached tokens, ownership, cancellation, admission."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

import pytest

from libs.bus.memory import InMemoryBus
from libs.protocol.codec import encode, unpack_tokens
from libs.protocol.member_messages import StepSample
from libs.protocol.messages import CancelRequest, FinishReason, SubmitStatus
from libs.runtime.settings import build_config
from services.scheduler.config import Config
from services.scheduler.service import SchedulerService
from tests.service.scheduler_harness import (
    PROMPT,
    SUBJECTS,
    ScriptedWorker,
    running,
    submit,
)
from tests.unit.scheduler.fake_worker import reference_output


async def test_tokens_flow_in_order_one_message_per_step(scheduler_stack) -> None:  # type: ignore[no-untyped-def]
    bus, _worker, outputs = scheduler_stack
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


async def test_choices_arrive_with_their_index(scheduler_stack) -> None:  # type: ignore[no-untyped-def]
    bus, _worker, outputs = scheduler_stack
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


async def test_cached_prompt_tokens_are_reported_per_tenant(scheduler_stack) -> None:  # type: ignore[no-untyped-def]
    bus, _worker, outputs = scheduler_stack
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


async def test_the_worker_is_claimed_with_an_empty_plan(scheduler_stack) -> None:  # type: ignore[no-untyped-def]
    _bus, worker, _outputs = scheduler_stack
    first = worker.plans[0]
    assert first.scheduler_id == "s1" and first.num_scheduled_seqs == 0


async def test_cancel_reaches_the_worker_even_when_idle(scheduler_stack) -> None:  # type: ignore[no-untyped-def]
    bus, worker, outputs = scheduler_stack
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


async def test_a_workers_start_up_profile_sets_its_step_time_model() -> None:
    bus = InMemoryBus()
    stop = asyncio.Event()
    service = SchedulerService(Config(scheduler_id="s1"), bus)
    task = asyncio.create_task(service.run(stop))
    await asyncio.sleep(0.01)
    # 40 ms a step, and 5 ms a token past the first (the shapes a worker times at start)
    shapes = [(r * (1 + k), r * k, r * (k > 0)) for k in (0, 1, 3, 7) for r in (1, 8)]
    profile = tuple(StepSample(t, d, r, 0.04 + 0.005 * (t - 1)) for t, d, r in shapes)
    worker = ScriptedWorker(bus, step_profile=profile)
    await worker.start()
    await asyncio.sleep(0.01)
    step_time = service.workers["w1"].core.speculator.policy.step_time
    assert step_time.num_profiled == len(shapes)
    assert step_time.seconds(16) == pytest.approx(0.04 + 0.005 * 15, rel=0.05)
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
