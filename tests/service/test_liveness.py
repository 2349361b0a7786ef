"""Liveness on the in-memory bus: the members view (heartbeats that stop, leaves, a stall of the
reader, stuck workers), and what each service does with it: the scheduler drops a worker whose
heartbeat stopped or that is stuck, the gateway fails the requests of a scheduler that is gone and
every request when the bus connection drops, the worker drops what an owner that claims it again
no longer knows about and lets go of an owner gone from the members bucket."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable

import pytest

from libs.bus import membership
from libs.bus.membership import MembershipView, announce, member_key
from libs.bus.memory import InMemoryBus
from libs.protocol.codec import encode, pack_tokens
from libs.protocol.member_messages import MemberInfo, MemberKind, OutSeq
from libs.protocol.messages import FinishReason, Handback, RequestOutput, SamplingParams, SchedulerOutput
from libs.protocol.subjects import Subjects
from services.gateway.request_stream import Delta
from services.gateway.service import GatewayService
from services.scheduler.config import Config as SchedulerConfig
from services.worker import service as worker_service
from tests.service.scheduler_harness import running_service, submit
from tests.service.test_gateway_service import ScriptedScheduler
from tests.service.test_worker_service import make_service, plan, step

SUBJECTS = Subjects()
BUCKET = SUBJECTS.members_bucket


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def put(bus: InMemoryBus, info: MemberInfo) -> None:
    await bus.ensure_kv(BUCKET, 0)  # no TTL here: the view's own silence check is under test
    await bus.kv_put(BUCKET, member_key(info), encode(info))


async def rest(deltas: AsyncIterable[Delta], timeout_s: float = 10) -> list[Delta]:
    """The stream's remaining deltas; fails if it does not end within ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        return [d async for d in deltas]


async def until(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


# --- the view --------------------------------------------------------------------------------


async def test_a_member_whose_heartbeat_stops_is_dead_and_a_stalled_reader_blames_no_one() -> None:
    bus, clock = InMemoryBus(), Clock()
    view = MembershipView(bus, BUCKET, silence_s=3.0, clock=clock)
    await put(bus, MemberInfo(MemberKind.WORKER, "w1", heartbeat=1))
    await view.refresh()
    assert [m.member_id for m in view.live(MemberKind.WORKER)] == ["w1"]
    for _ in range(4):  # read every second, the heartbeat never moves
        clock.now += 1.0
        await view.refresh()
    assert view.live(MemberKind.WORKER) == [] and view.get(MemberKind.WORKER, "w1") is None
    await put(bus, MemberInfo(MemberKind.WORKER, "w1", heartbeat=2))  # it is back
    clock.now += 1.0
    await view.refresh()
    assert view.get(MemberKind.WORKER, "w1") is not None
    clock.now += 10.0  # this reader stalled: no read for a long while, then one
    assert not view.current and view.live(MemberKind.WORKER) == []
    await view.refresh()
    assert view.get(MemberKind.WORKER, "w1") is not None  # its silence starts afresh
    await bus.kv_delete(BUCKET, member_key(MemberInfo(MemberKind.WORKER, "w1")))  # a clean leave
    await view.refresh()  # missing from one read: silent since it was last heard, not dead yet
    assert view.get(MemberKind.WORKER, "w1") is not None
    clock.now += 3.5
    await view.refresh()
    assert view.get(MemberKind.WORKER, "w1") is None


async def test_a_member_from_before_heartbeats_is_live_while_in_the_bucket() -> None:
    """A rolling upgrade: an older process's entry never moves its heartbeat (0)."""
    bus, clock = InMemoryBus(), Clock()
    view = MembershipView(bus, BUCKET, silence_s=3.0, clock=clock)
    await put(bus, MemberInfo(MemberKind.SCHEDULER, "old"))
    for _ in range(6):
        clock.now += 1.0
        await view.refresh()
        assert [m.member_id for m in view.live(MemberKind.SCHEDULER, confirmed=True)] == ["old"]
    await bus.kv_delete(BUCKET, member_key(MemberInfo(MemberKind.SCHEDULER, "old")))
    clock.now += 3.5
    await view.refresh()
    assert view.live(MemberKind.SCHEDULER) == []


async def test_the_stack_can_serve_only_with_a_heartbeating_pair_and_no_stuck_worker() -> None:
    clock = Clock()

    async def can_serve(*members: MemberInfo) -> bool:
        bus = InMemoryBus()
        view = MembershipView(bus, BUCKET, clock=clock)
        for info in members:
            await put(bus, info)
        await view.refresh()
        if view.can_serve():
            raise AssertionError("members not yet seen to heartbeat count as up")
        for info in members:
            await put(bus, dataclasses.replace(info, heartbeat=info.heartbeat + 1))
        clock.now += 1.0
        await view.refresh()
        return view.can_serve()

    sched = MemberInfo(MemberKind.SCHEDULER, "s1", heartbeat=1)
    worker = MemberInfo(MemberKind.WORKER, "w1", max_step_s=30.0, heartbeat=1)
    assert await can_serve(sched, worker)
    assert await can_serve(sched, dataclasses.replace(worker, owner="s1", step_s=2.0))
    assert not await can_serve(sched)
    # A scheduler that drives no worker yet (just started, or claiming them again after a NATS
    # outage) cannot serve; one that says 1 can.
    assert not await can_serve(dataclasses.replace(sched, num_workers=0), worker)
    assert await can_serve(dataclasses.replace(sched, num_workers=1), dataclasses.replace(worker, owner="s1"))
    assert not await can_serve(worker)
    assert not await can_serve(sched, dataclasses.replace(worker, step_s=31.0))  # stuck in a step
    assert not await can_serve(sched, dataclasses.replace(worker, owner="s-dead"))  # not free yet
    assert await can_serve(
        sched, dataclasses.replace(worker, ready=False), dataclasses.replace(worker, member_id="w2")
    )
    # A draining worker, or a prefill worker alone (it takes only handoffs), cannot serve.
    assert not await can_serve(sched, dataclasses.replace(worker, draining=True))
    assert not await can_serve(sched, dataclasses.replace(worker, role="prefill"))
    assert await can_serve(sched, dataclasses.replace(worker, role="decode"))


async def test_announce_moves_the_heartbeat_and_leaves_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(membership, "REFRESH_S", 0.01)
    bus = InMemoryBus()
    steps = iter(range(1000))
    stop = asyncio.Event()
    task = asyncio.create_task(
        announce(bus, BUCKET, lambda: MemberInfo(MemberKind.WORKER, "w1", step_s=float(next(steps))), stop)
    )
    view = MembershipView(bus, BUCKET)
    await until(lambda: bool(bus._kv.get(BUCKET)))
    await view.refresh()
    first = view.get(MemberKind.WORKER, "w1")
    await asyncio.sleep(0.05)
    await view.refresh()
    later = view.get(MemberKind.WORKER, "w1")
    assert first is not None and later is not None
    assert later.heartbeat > first.heartbeat and later.step_s > first.step_s  # read at each refresh
    stop.set()
    await task
    assert await bus.kv_items(BUCKET) == {}


# --- the scheduler ---------------------------------------------------------------------------


async def heartbeat(bus: InMemoryBus, info: Callable[[], MemberInfo]) -> asyncio.Task[None]:
    """A member's heartbeats until the task is cancelled: then its entry stays, frozen, as a
    process stopped by SIGSTOP or SIGKILL leaves it."""
    return asyncio.create_task(announce(bus, BUCKET, info, asyncio.Event()))


@pytest.mark.parametrize("fault", ["heartbeat stops", "stuck in a step"])
async def test_the_scheduler_drops_a_silent_or_stuck_worker_and_fails_its_requests(fault: str) -> None:
    config = SchedulerConfig(scheduler_id="s1", worker_timeout_s=2.5)
    async with running_service(config) as (service, bus, worker, outputs):
        step_s = 0.0
        beats = await heartbeat(
            bus, lambda: MemberInfo(MemberKind.WORKER, "w1", step_s=step_s, max_step_s=5.0)
        )
        await until(lambda: service.members.get(MemberKind.WORKER, "w1") is not None)
        worker.gate.clear()  # its next step never returns
        assert (await submit(bus, "r1", max_tokens=100)).scheduler_id == "s1"
        await asyncio.sleep(3.0)  # longer than worker_timeout_s: only the heartbeat tells
        assert "w1" in service.workers
        if fault == "heartbeat stops":
            beats.cancel()
            want = "worker w1 lost: no heartbeat"
        else:
            step_s = 6.0
            want = "worker w1 lost: stuck in a step for 6 s"
        out = await asyncio.wait_for(outputs.get(), 8)
        assert [(o.request_id, o.finish_reason, o.error) for o in out.outputs] == [
            ("r1", FinishReason.ERROR, want)
        ]
        assert "w1" not in service.workers
        worker.gate.set()
        if fault == "stuck in a step":
            await worker.publish_load()  # its loop still runs: load reports keep coming
            await asyncio.sleep(0.1)
            assert "w1" not in service.workers  # not claimed again while stuck
            step_s = 0.0  # the step returned: once the heartbeat says so, a load report claims it
            async with asyncio.timeout(10):
                while "w1" not in service.workers:
                    await worker.publish_load()
                    await asyncio.sleep(0.2)
        beats.cancel()


async def test_a_worker_with_no_subscriber_left_is_dropped_before_its_heartbeat_stops() -> None:
    """kill -9 closes the worker's connection and NATS drops its subscriptions: the probe of a slow
    step finds no responder, long before ``worker_timeout_s`` of heartbeat silence."""
    async with running_service(SchedulerConfig(scheduler_id="s1", worker_timeout_s=30)) as (
        service,
        bus,
        worker,
        outputs,
    ):
        worker.gate.clear()  # the step in flight never returns
        assert (await submit(bus, "r1", max_tokens=100)).scheduler_id == "s1"
        await asyncio.sleep(1.5)  # a probe meanwhile was answered: still there
        assert "w1" in service.workers
        await worker.subscription.unsubscribe()
        out = await asyncio.wait_for(outputs.get(), 4)  # a probe every second
        [(request_id, reason, error)] = [(o.request_id, o.finish_reason, o.error) for o in out.outputs]
        assert (request_id, reason) == ("r1", FinishReason.ERROR)
        assert error == "worker w1 lost: gone: nothing answers on its step subject"
        # no other worker here: handed back, for the gateway to move to another replica (it was
        # in the batch: one crash)
        assert [o.handback for o in out.outputs] == [Handback(num_moves=0, num_crashes=1)]
        assert "w1" not in service.workers
        worker.gate.set()


async def test_the_scheduler_drops_its_workers_when_the_bus_connection_drops_and_claims_them_back() -> None:
    async with running_service(SchedulerConfig(scheduler_id="s1")) as (service, bus, worker, outputs):
        worker.gate.clear()
        assert (await submit(bus, "r1", max_tokens=100)).scheduler_id == "s1"
        bus.set_connected(False)
        out = await asyncio.wait_for(outputs.get(), 5)
        (lost,) = out.outputs
        assert lost.finish_reason is FinishReason.ERROR and "NATS connection lost" in lost.error
        assert lost.handback is None  # every worker went at once: the gateway moves it, if need be
        assert service.workers == {}
        bus.set_connected(True)
        worker.gate.set()
        await worker.publish_load()  # its next load report after the reconnect
        await until(lambda: "w1" in service.workers and len(worker.plans) >= 3)
        claims = [p for p in worker.plans if p.step_id == 1]
        assert len(claims) == 2 and claims[1].num_scheduled_seqs == 0  # claimed again, afresh


# --- the gateway -----------------------------------------------------------------------------


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[GatewayService, InMemoryBus, ScriptedScheduler]]:
    bus = InMemoryBus()
    service = GatewayService(bus, SUBJECTS, "gw1", submit_timeout_s=1)
    await service.start()
    scheduler = ScriptedScheduler(bus)
    await scheduler.start()
    yield service, bus, scheduler
    await service.close()
    await bus.close()


async def test_the_gateway_fails_the_requests_of_a_scheduler_that_is_gone(
    gateway: tuple[GatewayService, InMemoryBus, ScriptedScheduler],
) -> None:
    service, bus, _scheduler = gateway
    service.members.silence_s = 3.0
    service.schedulers.loss_s = 4.0
    service.migrations.migration_limit = 0  # not moved (see test_gateway_migration)
    sched = await heartbeat(bus, lambda: MemberInfo(MemberKind.SCHEDULER, "s1"))
    work = await heartbeat(bus, lambda: MemberInfo(MemberKind.WORKER, "w1", owner="s1"))
    await until(service.ready)
    stream = await service.submit("r1", [1, 2, 3], SamplingParams(max_tokens=8), eos_token_id=0)
    await asyncio.sleep(1.0)
    assert service.ready()
    sched.cancel()  # killed: its entry stays, its heartbeat stops
    deltas = await rest(stream)
    assert [(d.finish_reason, d.error) for d in deltas] == [
        (FinishReason.ERROR, "scheduler s1 lost: no heartbeat; the migration limit (0 moves) is reached")
    ]
    assert not service.ready()
    work.cancel()


async def test_the_gateway_fails_every_request_when_the_bus_connection_drops(
    gateway: tuple[GatewayService, InMemoryBus, ScriptedScheduler],
) -> None:
    service, bus, scheduler = gateway
    sched = await heartbeat(bus, lambda: MemberInfo(MemberKind.SCHEDULER, "s1"))
    work = await heartbeat(bus, lambda: MemberInfo(MemberKind.WORKER, "w1"))
    await until(service.ready)
    stream = await service.submit("r1", [1, 2, 3], SamplingParams(max_tokens=8), eos_token_id=0)
    await scheduler.emit(RequestOutput("r1", pack_tokens([5]), 1, 3))
    deltas = stream.__aiter__()
    assert (await anext(deltas)).token_ids == [5]
    bus.set_connected(False)
    assert not service.ready()
    (lost,) = await rest(deltas)
    assert lost.finish_reason is FinishReason.ERROR and "NATS connection lost" in lost.error
    bus.set_connected(True)
    await until(service.ready)
    # Outputs lost in the outage left a gap in the scheduler's numbering: no fault of a new request
    # (its reply says what had been sent, the lost ones included).
    scheduler.seq += 4
    again = await service.submit("r2", [1, 2, 3], SamplingParams(max_tokens=1), eos_token_id=0)
    await scheduler.emit(RequestOutput("r2", pack_tokens([5]), 1, 3, FinishReason.LENGTH))
    assert [(d.finish_reason, d.error) for d in await rest(again)] == [(FinishReason.LENGTH, "")]
    sched.cancel()
    work.cancel()


async def test_the_gateway_fails_requests_whose_last_outputs_never_came(
    gateway: tuple[GatewayService, InMemoryBus, ScriptedScheduler],
) -> None:
    service, bus, scheduler = gateway
    service.numbering.lag_s = 1.0
    sent = 1  # what the scheduler's heartbeat says it published to gw1

    def sched_info() -> MemberInfo:
        return MemberInfo(MemberKind.SCHEDULER, "s1", out_seqs=(OutSeq("gw1", sent),))

    sched = await heartbeat(bus, sched_info)
    work = await heartbeat(bus, lambda: MemberInfo(MemberKind.WORKER, "w1"))
    await until(service.ready)
    stream = await service.submit("r1", [1, 2, 3], SamplingParams(max_tokens=8), eos_token_id=0)
    await scheduler.emit(RequestOutput("r1", pack_tokens([5]), 1, 3))
    deltas = stream.__aiter__()
    assert (await anext(deltas)).token_ids == [5]
    await asyncio.sleep(2.0)  # all it sent has arrived: nothing to fail however long it is quiet
    sent = 2  # its message 2, r1's last, went missing, and nothing follows to show the gap
    (lost,) = await rest(deltas)
    assert (lost.finish_reason, lost.error) == (
        FinishReason.ERROR,
        "lost step outputs of scheduler s1 (up to 2)",
    )
    sched.cancel()
    work.cancel()


async def test_the_gateway_fails_a_request_whose_only_output_never_came(
    gateway: tuple[GatewayService, InMemoryBus, ScriptedScheduler],
) -> None:
    """No output of the scheduler ever arrived here, so no gap can show; its submit reply said
    what it had sent so far (0), and its heartbeat then says 1 (the request's end, lost)."""
    service, bus, _ = gateway
    service.numbering.lag_s = 1.0
    sent = 0

    def sched_info() -> MemberInfo:
        return MemberInfo(MemberKind.SCHEDULER, "s1", out_seqs=(OutSeq("gw1", sent),))

    sched = await heartbeat(bus, sched_info)
    work = await heartbeat(bus, lambda: MemberInfo(MemberKind.WORKER, "w1"))
    await until(service.ready)
    stream = await service.submit("r1", [1, 2, 3], SamplingParams(max_tokens=8), eos_token_id=0)
    sent = 1
    (lost,) = await rest(stream.__aiter__())
    assert (lost.finish_reason, lost.error) == (
        FinishReason.ERROR,
        "lost step outputs of scheduler s1 (up to 1)",
    )
    sched.cancel()
    work.cancel()


async def test_an_output_older_than_the_submit_reply_is_no_gap(
    gateway: tuple[GatewayService, InMemoryBus, ScriptedScheduler],
) -> None:
    """The reply (out_seq 1) overtook output 1, published before the scheduler accepted."""
    service, bus, scheduler = gateway
    sched = await heartbeat(bus, lambda: MemberInfo(MemberKind.SCHEDULER, "s1"))
    work = await heartbeat(bus, lambda: MemberInfo(MemberKind.WORKER, "w1"))
    await until(service.ready)
    scheduler.seq = 1  # said in the reply; the output itself comes after
    stream = await service.submit("r1", [1, 2, 3], SamplingParams(max_tokens=8), eos_token_id=0)
    await scheduler.emit(RequestOutput("other", pack_tokens([9]), 1, 3), seq=1)
    await scheduler.emit(RequestOutput("r1", pack_tokens([5]), 1, 3, FinishReason.STOP), seq=2)
    (delta,) = await rest(stream.__aiter__())
    assert (delta.token_ids, delta.finish_reason, delta.error) == ([5], FinishReason.STOP, "")
    sched.cancel()
    work.cancel()


# --- the worker ------------------------------------------------------------------------------


async def test_a_worker_claimed_again_by_its_owner_drops_what_it_held() -> None:
    bus = InMemoryBus()
    service = make_service(bus, orphan_timeout_s=30)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await asyncio.sleep(0.01)
    assert (await step(bus, plan(1, "s1", "a", block=0))).seq_ids == ("a",)
    assert (await step(bus, encode(SchedulerOutput(2, scheduler_id="s1")))).num_running_seqs == 1
    claim = await step(bus, encode(SchedulerOutput(1, scheduler_id="s1")))  # a fresh core's first plan
    assert not claim.error and claim.num_running_seqs == 0 and service.runner.seqs == {}
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_a_worker_heartbeat_says_how_long_its_step_runs() -> None:
    bus = InMemoryBus()
    service = make_service(bus, orphan_timeout_s=30)
    service.config = dataclasses.replace(service.config, max_step_s=0.2)
    release = threading.Event()
    execute = service.runner.execute

    def slow_execute(p: SchedulerOutput) -> object:
        release.wait(10)
        return execute(p)

    service.runner.execute = slow_execute  # type: ignore[method-assign,assignment]
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await asyncio.sleep(0.01)
    assert service.member_info().step_s == 0.0
    stepping = asyncio.create_task(step(bus, plan(1, "s1", "a", block=0)))
    await until(lambda: service.member_info().stuck)  # the step runs past max_step_s
    info = service.member_info()
    assert info.step_s > 0.2 and info.owner == "s1"
    release.set()
    assert (await stepping).seq_ids == ("a",)
    assert not service.member_info().stuck
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_a_worker_lets_go_of_an_owner_missing_from_membership_for_a_ttl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_service, "MEMBER_TTL_S", 0.2)
    bus = InMemoryBus()
    service = make_service(bus, orphan_timeout_s=30)  # far longer than this test: membership tells
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await asyncio.sleep(0.01)
    owner = await heartbeat(bus, lambda: MemberInfo(MemberKind.SCHEDULER, "s1"))
    assert (await step(bus, plan(1, "s1", "a", block=0))).seq_ids == ("a",)
    await asyncio.sleep(0.3)  # silent past the TTL, but still a member: a busy owner
    assert await service.drop_orphans() == 0
    await asyncio.sleep(0.3)
    assert await service.drop_orphans() == 0 and service.owner == "s1"
    owner.cancel()
    await bus.kv_delete(BUCKET, member_key(MemberInfo(MemberKind.SCHEDULER, "s1")))  # its entry expired
    assert await service.drop_orphans() == 0  # missing once is not enough
    await asyncio.sleep(0.3)
    assert await service.drop_orphans() == 1 and service.owner == "" and service.runner.seqs == {}
    stop.set()
    await asyncio.wait_for(task, 5)
