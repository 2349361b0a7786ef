"""The scheduler service pauses and resumes requests on the bus (PauseRequest): a paused request
leaves the worker and publishes nothing until resumed, then goes on with exactly the tokens it
would have produced; one paused past its deadline is cancelled and its end published."""

from __future__ import annotations

import asyncio

from libs.protocol.codec import encode, unpack_tokens
from libs.protocol.messages import FinishReason, PauseRequest, StepOutputs
from tests.service.scheduler_harness import PROMPT, SUBJECTS, ScriptedWorker, submit
from tests.unit.scheduler.fake_worker import reference_output

MAX_TOKENS = 40


async def drain(outputs: asyncio.Queue[StepOutputs], quiet_s: float) -> list[int]:
    """The tokens published until nothing more came for ``quiet_s``."""
    tokens: list[int] = []
    while True:
        try:
            step = await asyncio.wait_for(outputs.get(), quiet_s)
        except TimeoutError:
            return tokens
        for out in step.outputs:
            tokens += unpack_tokens(out.new_token_ids)


async def until_dropped(worker: ScriptedWorker, seq_id: str) -> None:
    for _ in range(200):
        if seq_id not in worker.held:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{seq_id} is still on the worker")


async def test_a_paused_request_stops_at_once_and_resumes_exactly(scheduler_stack) -> None:  # type: ignore[no-untyped-def]
    bus, worker, outputs = scheduler_stack
    await submit(bus, "r1", max_tokens=MAX_TOKENS)
    (first,) = (await asyncio.wait_for(outputs.get(), 2)).outputs
    worker.gate.clear()  # hold the worker so the pause lands between steps
    await asyncio.sleep(0.01)
    await bus.publish(SUBJECTS.pause, encode(PauseRequest(("r1",))))
    await asyncio.sleep(0.01)
    worker.gate.set()
    await until_dropped(worker, "r1")
    got = unpack_tokens(first.new_token_ids) + await drain(outputs, 0.2)  # plans already sent
    assert len(got) < MAX_TOKENS // 2  # it stopped long before its end
    num_steps = len(worker.plans)
    assert await drain(outputs, 0.3) == []  # nothing while paused
    assert all("r1" not in p.seq_ids for p in worker.plans[num_steps - 1 :])
    await bus.publish(SUBJECTS.pause, encode(PauseRequest(("r1",), resume=True)))
    while True:
        (out,) = (await asyncio.wait_for(outputs.get(), 2)).outputs
        got += unpack_tokens(out.new_token_ids)
        assert out.num_output_tokens == len(got)
        if out.finish_reason is not None:
            break
    assert out.finish_reason is FinishReason.LENGTH
    assert got == reference_output(PROMPT, MAX_TOKENS, 64, ignore_eos=True)


async def test_a_request_paused_past_its_deadline_is_cancelled(scheduler_stack) -> None:  # type: ignore[no-untyped-def]
    bus, worker, outputs = scheduler_stack
    await submit(bus, "r1", max_tokens=1000)
    await asyncio.wait_for(outputs.get(), 2)
    await bus.publish(SUBJECTS.pause, encode(PauseRequest(("r1",), timeout_s=0.05)))
    await until_dropped(worker, "r1")
    while True:  # the expiry runs every second
        (out,) = (await asyncio.wait_for(outputs.get(), 3)).outputs
        if out.finish_reason is not None:
            break
    assert out.finish_reason is FinishReason.ABORT


async def test_a_stale_pause_from_the_gateway_a_reader_left_is_ignored(scheduler_stack) -> None:  # type: ignore[no-untyped-def]
    """g1's pause overtook g2's resume: g1's arriving after it must not stop the request."""
    bus, _, outputs = scheduler_stack
    await submit(bus, "r1", max_tokens=MAX_TOKENS)
    (first,) = (await asyncio.wait_for(outputs.get(), 2)).outputs
    await bus.publish(SUBJECTS.pause, encode(PauseRequest(("r1",), resume=True, gateway_id="g2")))
    await bus.publish(SUBJECTS.pause, encode(PauseRequest(("r1",), gateway_id="g1")))
    got = unpack_tokens(first.new_token_ids)
    while True:
        (out,) = (await asyncio.wait_for(outputs.get(), 2)).outputs
        got += unpack_tokens(out.new_token_ids)
        if out.finish_reason is not None:
            break
    assert out.finish_reason is FinishReason.LENGTH and len(got) == MAX_TOKENS
