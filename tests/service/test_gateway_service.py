"""The gateway's bus side on the in-memory bus, with a scripted scheduler: demux, loss detection, cancel."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from libs.bus.base import Message
from libs.bus.memory import InMemoryBus
from libs.protocol.codec import decode, encode, pack_tokens
from libs.protocol.messages import (
    CancelRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    SubmitReply,
    SubmitRequest,
    SubmitStatus,
)
from libs.protocol.subjects import Subjects
from services.gateway.service import Delta, GatewayService, SubmitRejected

SUBJECTS = Subjects()
PARAMS = SamplingParams(temperature=0.0, max_tokens=8)


class ScriptedScheduler:
    def __init__(self, bus: InMemoryBus, status: SubmitStatus = SubmitStatus.ACCEPTED) -> None:
        self.bus = bus
        self.status = status
        self.submitted: list[SubmitRequest] = []
        self.cancelled: list[str] = []
        self.seq = 0

    async def start(self) -> None:
        await self.bus.subscribe(SUBJECTS.submit, self.on_submit, queue="schedulers")
        await self.bus.subscribe(SUBJECTS.cancel, self.on_cancel)

    async def on_submit(self, msg: Message) -> None:
        self.submitted.append(decode(SubmitRequest, msg.data))
        await self.bus.respond(msg, encode(SubmitReply(self.status, "busy", scheduler_id="s1")))

    async def on_cancel(self, msg: Message) -> None:
        self.cancelled += decode(CancelRequest, msg.data).request_ids

    async def emit(self, *outputs: RequestOutput, seq: int | None = None) -> None:
        self.seq = self.seq + 1 if seq is None else seq
        step = StepOutputs("s1", self.seq, outputs)
        await self.bus.publish_durable(SUBJECTS.out("gw1"), encode(step))


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[GatewayService, ScriptedScheduler]]:
    bus = InMemoryBus()
    service = GatewayService(bus, SUBJECTS, "gw1", submit_timeout_s=1)
    await service.start()
    scheduler = ScriptedScheduler(bus)
    await scheduler.start()
    yield service, scheduler
    await bus.close()


def out(request_id: str, tokens: list[int], total: int, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput(request_id, pack_tokens(tokens), total, 3, finish)


async def drain(stream: AsyncIterator[Delta]) -> list[Delta]:
    return [d async for d in stream]


async def test_outputs_of_two_requests_are_demuxed(gateway) -> None:  # type: ignore[no-untyped-def]
    service, scheduler = gateway
    a = await service.submit("a", [1, 2, 3], PARAMS, 2)
    b = await service.submit("b", [4, 5, 6], PARAMS, 2)
    await scheduler.emit(out("a", [10], 1), out("b", [20], 1))
    await scheduler.emit(out("b", [21], 2, FinishReason.STOP), out("a", [11], 2))
    await scheduler.emit(out("a", [12], 3, FinishReason.LENGTH))
    deltas_a, deltas_b = await asyncio.wait_for(asyncio.gather(drain(a), drain(b)), 2)
    assert [t for d in deltas_a for t in d.token_ids] == [10, 11, 12]
    assert [t for d in deltas_b for t in d.token_ids] == [20, 21]
    assert (
        deltas_a[-1].finish_reason is FinishReason.LENGTH and deltas_b[-1].finish_reason is FinishReason.STOP
    )
    assert service.num_in_flight == 2  # until each stream is closed
    a.close()
    b.close()
    assert service.num_in_flight == 0 and scheduler.cancelled == []


async def test_a_gap_in_step_sequence_fails_the_request_loudly(gateway) -> None:  # type: ignore[no-untyped-def]
    service, scheduler = gateway
    a = await service.submit("a", [1], PARAMS, 2)
    await scheduler.emit(out("a", [10], 1))
    await scheduler.emit(out("a", [12], 3), seq=3)  # message 2 was lost
    deltas = await asyncio.wait_for(drain(a), 2)
    assert deltas[-1].finish_reason is FinishReason.ERROR and "lost" in deltas[-1].error


async def test_lost_tokens_are_detected_per_request(gateway) -> None:  # type: ignore[no-untyped-def]
    service, scheduler = gateway
    a = await service.submit("a", [1], PARAMS, 2)
    await scheduler.emit(out("a", [10], 2))  # claims two tokens, carries one
    deltas = await asyncio.wait_for(drain(a), 2)
    assert deltas[-1].finish_reason is FinishReason.ERROR and "lost tokens" in deltas[-1].error


async def test_closing_early_cancels(gateway) -> None:  # type: ignore[no-untyped-def]
    service, scheduler = gateway
    a = await service.submit("a", [1], PARAMS, 2)
    await scheduler.emit(out("a", [10], 1))
    async for _ in a:
        break
    a.close()
    a.close()  # idempotent
    await asyncio.sleep(0.01)
    assert scheduler.cancelled == ["a"]
    assert service.num_in_flight == 0


async def test_rejections() -> None:
    bus = InMemoryBus()
    service = GatewayService(bus, SUBJECTS, "gw1", submit_timeout_s=1)
    await service.start()
    with pytest.raises(SubmitRejected) as info:  # no scheduler at all
        await service.submit("a", [1], PARAMS, 2)
    assert info.value.status is SubmitStatus.NO_WORKERS
    scheduler = ScriptedScheduler(bus, SubmitStatus.QUEUE_FULL)
    await scheduler.start()
    with pytest.raises(SubmitRejected) as info:
        await service.submit("b", [1], PARAMS, 2)
    assert info.value.status is SubmitStatus.QUEUE_FULL
    assert service.num_in_flight == 0
    await bus.close()
