"""The gateway pauses a resumable stream its last reader left, on the bus, at once (and cancels it
when the grace period ends); a replay resumes it; a request nobody can resume is cancelled, never
paused."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest

from libs.bus.base import Message
from libs.bus.memory import InMemoryBus
from libs.protocol.codec import decode, unpack_tokens
from libs.protocol.messages import PauseRequest, SchedulerRef
from services.gateway.service import GatewayService
from tests.service.test_gateway_service import PARAMS, SUBJECTS, ScriptedScheduler, out, record_for

GRACE_S = 0.2

Gateway = tuple[GatewayService, ScriptedScheduler, list[PauseRequest]]


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    bus = InMemoryBus()
    service = GatewayService(bus, SUBJECTS, "gw1", submit_timeout_s=1, resume_grace_s=GRACE_S)
    await service.start()
    scheduler = ScriptedScheduler(bus)
    await scheduler.start()
    pauses: list[PauseRequest] = []

    async def on_pause(msg: Message) -> None:
        pauses.append(decode(PauseRequest, msg.data))

    await bus.subscribe(SUBJECTS.pause, on_pause)
    yield service, scheduler, pauses
    await bus.close()


async def test_a_stream_left_unfinished_pauses_at_once_and_a_replay_resumes_it(gateway: Gateway) -> None:
    service, scheduler, pauses = gateway
    record = record_for(service, "r1", service.next_out_seq())
    stream = await service.submit("r1", [1, 2, 3], PARAMS, 0, record)
    await scheduler.emit(out("r1", [5], 1))
    assert (await anext(aiter(stream))).token_ids == [5]
    stream.close()
    await asyncio.sleep(0.01)
    assert pauses == [
        PauseRequest(("r1",), resume=False, timeout_s=2 * GRACE_S, gateway_id=service.gateway_id)
    ]
    assert scheduler.cancelled == []  # paused, kept for a resume
    stored = await service.stream_record("r1")  # with what a resume needs to move it
    assert stored is not None and stored.schedulers == (SchedulerRef(scheduler.scheduler_id),)
    assert stored.submit is not None and unpack_tokens(stored.submit.prompt_token_ids) == [1, 2, 3]
    assert dataclasses.replace(stored, submit=None, schedulers=()) == record
    replay = await service.replay(stored)
    await asyncio.sleep(GRACE_S * 2)
    assert pauses[1:] and all(p.resume for p in pauses[1:])  # resumed; no pause since
    assert scheduler.cancelled == []
    replay.close()  # its reader leaves too: paused again, then cancelled after the grace period
    await asyncio.sleep(GRACE_S * 2)
    assert not pauses[-1].resume and scheduler.cancelled == ["r1"]


async def test_a_request_nobody_can_resume_is_cancelled_not_paused(gateway: Gateway) -> None:
    service, scheduler, pauses = gateway
    stream = await service.submit("r1", [1, 2, 3], PARAMS, 0)  # no stream record: not resumable
    await scheduler.emit(out("r1", [5], 1))
    assert (await anext(aiter(stream))).token_ids == [5]
    stream.close()
    await asyncio.sleep(0.01)
    assert scheduler.cancelled == ["r1"] and pauses == []
