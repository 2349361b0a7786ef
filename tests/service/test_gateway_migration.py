"""The gateway moves the requests of a lost scheduler (on the in-memory bus, scripted schedulers):
each is resubmitted to another scheduler with the tokens its client has, per choice, and its
stream goes on without an error; outputs still coming from the lost one are dropped; a move that
finds no taker within the window, or past the migration limit, ends the stream with an error; a
resubmit whose reply timed out is retried at the same scheduler, never sent to a second one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from libs.bus.base import Message
from libs.bus.memory import InMemoryBus
from libs.protocol.codec import decode, pack_tokens, unpack_tokens
from libs.protocol.member_messages import MemberInfo, MemberKind
from libs.protocol.messages import FinishReason, RequestOutput, SamplingParams, SubmitRequest
from services.gateway.service import GatewayService
from tests.service.test_gateway_service import SUBJECTS, ScriptedScheduler
from tests.service.test_liveness import heartbeat, rest, until

PARAMS = SamplingParams(max_tokens=8, n=2)


def out(tokens: list[int], total: int, index: int, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput("r1", pack_tokens(tokens), total, 3, finish, index=index)


@dataclass
class Scene:
    """A gateway, scheduler s1 (scripted) driving worker w1, each heartbeating until ``close``."""

    service: GatewayService
    bus: InMemoryBus
    first: ScriptedScheduler
    beats: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    async def join(self, scheduler: ScriptedScheduler, *others: GatewayService) -> ScriptedScheduler:
        """Another scheduler, live in the gateway's view (and in the ``others``') when this returns."""
        await scheduler.start()
        sid = scheduler.scheduler_id
        self.beats[sid] = await heartbeat(self.bus, lambda: MemberInfo(MemberKind.SCHEDULER, sid))
        for gateway in (self.service, *others):
            await until(lambda g=gateway: sid in {m.member_id for m in g.members.live(MemberKind.SCHEDULER)})
        return scheduler

    async def kill_first(self) -> None:
        """s1 is gone: it answers nothing more and its heartbeat stops (its entry stays)."""
        await self.first.stop()
        self.beats.pop("s1").cancel()

    def close(self) -> None:
        for beat in self.beats.values():
            beat.cancel()


def make_gateway(bus: InMemoryBus, gateway_id: str) -> GatewayService:
    """A gateway with short liveness bounds (a scheduler counts as lost after 2 s)."""
    service = GatewayService(bus, SUBJECTS, gateway_id, submit_timeout_s=1, resubmit_window_s=2.0)
    service.members.silence_s = 1.5
    service.schedulers.loss_s = 2.0
    return service


@pytest.fixture
async def scene() -> AsyncIterator[Scene]:
    bus = InMemoryBus()
    service = make_gateway(bus, "gw1")
    await service.start()
    first = ScriptedScheduler(bus)
    scene = Scene(service, bus, first)
    await scene.join(first)
    scene.beats["w1"] = await heartbeat(bus, lambda: MemberInfo(MemberKind.WORKER, "w1", owner="s1"))
    await until(service.ready)
    yield scene
    scene.close()
    await service.close()
    await bus.close()


async def test_a_lost_schedulers_request_goes_on_at_another_with_the_tokens_received(scene: Scene) -> None:
    service, first = scene.service, scene.first
    stream = await service.submit("r1", [1, 2, 3], PARAMS, eos_token_id=0)
    await first.emit(out([5], 1, 0), out([7], 1, 1))
    await first.emit(out([6], 2, 0), out([8], 2, 1, FinishReason.STOP))
    await scene.kill_first()
    second = await scene.join(ScriptedScheduler(scene.bus, scheduler_id="s2"))
    await until(lambda: bool(second.submitted))
    (req,) = second.submitted
    assert [unpack_tokens(t) for t in req.output_token_ids] == [[5, 6], [7, 8]]
    assert (req.finished_choices, req.num_moves, req.request_id) == ((1,), 1, "r1")
    await first.emit(out([66], 3, 0))  # late, from the lost one: dropped
    await second.emit(out([9], 3, 0, FinishReason.LENGTH))
    deltas = await rest(stream)
    assert [(d.index, d.token_ids, d.error) for d in deltas] == [
        (0, [5], ""),
        (1, [7], ""),
        (0, [6], ""),
        (1, [8], ""),
        (0, [9], ""),
    ]
    assert service.migrations.num_moves == {"moved": 1, "failed": 0}


async def test_a_move_that_finds_no_scheduler_ends_the_stream_with_an_error(scene: Scene) -> None:
    stream = await scene.service.submit("r1", [1, 2, 3], PARAMS, eos_token_id=0)
    await scene.first.emit(out([5], 1, 0))
    await scene.kill_first()
    deltas = await rest(stream)
    assert deltas[0].token_ids == [5]
    errors = {d.index: d.error for d in deltas[1:]}
    assert set(errors) == {0, 1}
    for error in errors.values():
        assert error == (
            "scheduler s1 lost: no heartbeat; not moved to another scheduler: no scheduler is available"
        )
    assert scene.service.migrations.num_moves == {"moved": 0, "failed": 1}


class SlowFirst(ScriptedScheduler):
    """Answers its first submit too late (after the gateway's timeout): it may have taken it."""

    async def on_submit(self, msg: Message) -> None:
        if not self.submitted:
            self.submitted.append(decode(SubmitRequest, msg.data))
            await asyncio.sleep(1.5)
            return
        await super().on_submit(msg)


async def test_a_resubmit_that_timed_out_is_retried_at_the_same_scheduler(scene: Scene) -> None:
    stream = await scene.service.submit("r1", [1, 2, 3], SamplingParams(max_tokens=8), eos_token_id=0)
    await scene.first.emit(out([5], 1, 0))
    slow = await scene.join(SlowFirst(scene.bus, scheduler_id="s2"))
    other = await scene.join(ScriptedScheduler(scene.bus, scheduler_id="s3"))
    await scene.kill_first()
    await until(lambda: len(slow.submitted) == 2, timeout_s=15)
    assert other.submitted == []  # never sent to a second scheduler: it cannot run twice
    await slow.emit(out([6], 2, 0, FinishReason.LENGTH))
    deltas = await rest(stream)
    assert [(d.token_ids, d.error) for d in deltas] == [([5], ""), ([6], "")]
