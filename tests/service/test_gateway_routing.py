"""The gateway's KV router on the bus (in-memory bus, scripted schedulers): a submit goes to the
replica that owns the worker holding the prompt's blocks, naming that worker; a stream with a gap
gets a dump asked of its publisher, and the dump's content counts; the workers of a replica that
is gone (no answer, or not live in the members) are not named; a replica with no worker that the
queue group picks passes the submit to one that has workers."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import pytest

from libs.bus.base import Message
from libs.bus.memory import InMemoryBus
from libs.kvstore.block_hash import hash_blocks
from libs.protocol.codec import decode, encode
from libs.protocol.kv_messages import CacheTier, KVDump, KVDumpRequest, KVEvent, KVEvents, join_hashes
from libs.protocol.member_messages import MemberInfo, MemberKind, WorkerLoad
from libs.protocol.messages import SamplingParams, SubmitStatus
from services.gateway.kv_router import KVRouter
from services.gateway.metrics import GatewayMetrics
from services.gateway.service import GatewayService, SubmitRejected
from tests.service.test_gateway_service import SUBJECTS, ScriptedScheduler
from tests.service.test_liveness import heartbeat, until

BLOCK_SIZE = 4
PROMPT = list(range(10, 51))  # 10 full blocks a hit could skip
CHAIN = hash_blocks(PROMPT[:40], BLOCK_SIZE, "m", "")
PARAMS = SamplingParams(max_tokens=4)


def load(worker_id: str, owner: str) -> WorkerLoad:
    return WorkerLoad(worker_id, 0, 8, 4096, 256, BLOCK_SIZE, model="m", owner=owner)


def g1(scheduler_id: str, worker_id: str, seq: int, hashes: list[bytes]) -> KVEvents:
    event = KVEvent(CacheTier.DEVICE, True, join_hashes(hashes))
    return KVEvents(scheduler_id, seq, (event,) if hashes else (), "m", worker_id)


Fleet = tuple[GatewayService, InMemoryBus, dict[str, ScriptedScheduler], dict[str, asyncio.Task[None]]]


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    bus = InMemoryBus()
    service = GatewayService(bus, SUBJECTS, "gw1", submit_timeout_s=1, router=KVRouter())
    await service.start()
    schedulers = {sid: ScriptedScheduler(bus, scheduler_id=sid) for sid in ("s1", "s2")}
    beats = {}
    for sid, scheduler in schedulers.items():
        await scheduler.start()
        beats[sid] = await heartbeat(
            bus, functools.partial(MemberInfo, MemberKind.SCHEDULER, sid, num_workers=1)
        )
    await until(lambda: len(service.members.live(MemberKind.SCHEDULER)) == 2)
    for worker_id, owner in (("w1", "s1"), ("w2", "s2")):
        await bus.publish(SUBJECTS.load(worker_id), encode(load(worker_id, owner)))
    await until(lambda: service.router is not None and len(service.router.router.workers) == 2)
    yield service, bus, schedulers, beats
    for beat in beats.values():
        beat.cancel()
    await service.close()
    await bus.close()


async def test_a_submit_goes_to_the_replica_holding_the_prompt_and_names_the_worker(fleet: Fleet) -> None:
    service, bus, schedulers, _ = fleet
    await bus.publish(SUBJECTS.kv_device_events, encode(g1("s2", "w2", 1, CHAIN)))
    assert service.router is not None
    await until(lambda: bool(service.router and service.router.router.streams))
    for i in range(3):
        await service.submit(f"r{i}", PROMPT, PARAMS, eos_token_id=0)
    assert [r.worker_id for r in schedulers["s2"].submitted] == ["w2"] * 3
    assert schedulers["s1"].submitted == []
    text = GatewayMetrics(service).exposition().decode()
    assert 'deepinfer_router_routes_total{worker_id="w2"} 3.0' in text
    assert "deepinfer_router_cached_blocks_total 30.0" in text  # 3 routes x 10 blocks held
    assert "deepinfer_router_prompt_blocks_total 30.0" in text


async def test_a_gap_asks_the_publisher_for_a_dump_and_its_content_counts(fleet: Fleet) -> None:
    service, bus, schedulers, _ = fleet
    asked: list[KVDumpRequest] = []

    async def dump(msg: Message) -> None:
        request = decode(KVDumpRequest, msg.data)
        asked.append(request)
        await bus.respond(msg, encode(KVDump("s1", 5, b"", request.worker_id, join_hashes(CHAIN))))

    await bus.subscribe(SUBJECTS.kv_dump("s1"), dump)
    await bus.publish(SUBJECTS.kv_device_events, encode(g1("s1", "w1", 1, [])))
    await bus.publish(SUBJECTS.kv_device_events, encode(g1("s1", "w1", 3, [])))  # 2 never came
    await until(lambda: bool(asked))
    assert asked == [KVDumpRequest("s1", "w1")]
    assert service.router is not None
    await until(lambda: service.router is not None and service.router.num_dumps["applied"] == 1)
    await service.submit("r1", PROMPT, PARAMS, eos_token_id=0)
    assert [r.worker_id for r in schedulers["s1"].submitted] == ["w1"]


async def test_with_the_named_replica_gone_the_router_names_a_live_one(fleet: Fleet) -> None:
    service, bus, schedulers, _ = fleet
    await bus.publish(SUBJECTS.kv_device_events, encode(g1("s2", "w2", 1, CHAIN)))
    await until(lambda: bool(service.router and service.router.router.streams))
    await schedulers["s2"].stop()  # killed: its worker's last report still names it
    await service.submit("r1", PROMPT, PARAMS, eos_token_id=0)
    (req,) = schedulers["s1"].submitted
    assert req.worker_id == "w1"  # the router asked again, without s2


async def test_the_router_names_no_worker_of_a_scheduler_gone_from_the_members(fleet: Fleet) -> None:
    service, bus, schedulers, beats = fleet
    await bus.publish(SUBJECTS.kv_device_events, encode(g1("s2", "w2", 1, CHAIN)))
    await until(lambda: bool(service.router and service.router.router.streams))
    beats["s2"].cancel()  # its heartbeat stops (it still answers submits: stuck, or cut off)
    service.members.silence_s = 1.0
    await until(lambda: len(service.members.live(MemberKind.SCHEDULER)) == 1)
    await service.submit("r1", PROMPT, PARAMS, eos_token_id=0)
    assert schedulers["s2"].submitted == []
    assert [r.worker_id for r in schedulers["s1"].submitted] == ["w1"]


async def test_a_replica_without_workers_in_the_queue_group_passes_to_one_with_workers() -> None:
    """No route (no worker report yet): the queue group's pick is a replica that has no worker
    (just restarted); the gateway then names the live replica that drives one."""
    bus = InMemoryBus()
    service = GatewayService(bus, SUBJECTS, "gw1", submit_timeout_s=1, router=KVRouter())
    await service.start()
    empty = ScriptedScheduler(bus, SubmitStatus.NO_WORKERS, scheduler_id="s1")
    busy = ScriptedScheduler(bus, scheduler_id="s2")
    await empty.start()
    await busy.start()
    await busy.subscriptions[0].unsubscribe()  # the queue group reaches only the empty one
    beats = [
        await heartbeat(bus, lambda: MemberInfo(MemberKind.SCHEDULER, "s1", num_workers=0)),
        await heartbeat(bus, lambda: MemberInfo(MemberKind.SCHEDULER, "s2", num_workers=1)),
    ]
    await until(lambda: len(service.members.live(MemberKind.SCHEDULER)) == 2)
    await service.submit("r1", PROMPT, PARAMS, eos_token_id=0)
    assert [r.request_id for r in empty.submitted] == ["r1"]
    assert [r.request_id for r in busy.submitted] == ["r1"]
    empty.status = SubmitStatus.NO_WORKERS
    await busy.stop()  # now no replica can take it: the client sees the refusal
    with pytest.raises(SubmitRejected) as rejected:
        await service.submit("r2", PROMPT, PARAMS, eos_token_id=0)
    assert rejected.value.status is SubmitStatus.NO_WORKERS
    for beat in beats:
        beat.cancel()
    await service.close()
    await bus.close()
