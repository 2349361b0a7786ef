"""The scheduler's side of cross-replica routing (in-memory bus, scripted workers): it publishes
each driven worker's G1 as a stream of KV events (cached and dropped block hashes, numbered from
1), answers a dump of that stream, places a submit on the worker the gateway's router named while
that worker has room, and leaves a free worker to a replica driving fewer workers for a while."""

from __future__ import annotations

import asyncio
import time

import pytest

from libs.bus.base import Message
from libs.bus.membership import announce
from libs.protocol.codec import decode, encode, pack_tokens
from libs.protocol.kv_messages import CacheTier, KVDump, KVDumpRequest, KVEvents, split_hashes
from libs.protocol.member_messages import MemberInfo, MemberKind
from libs.protocol.messages import SamplingParams, SubmitReply, SubmitRequest, SubmitStatus
from services.scheduler import service as scheduler_service
from services.scheduler.config import Config
from tests.service.scheduler_harness import SUBJECTS, ScriptedWorker, running_service
from tests.unit.scheduler.fake_worker import EOS

PROMPT = list(range(5, 30))  # 6 full blocks of 4, the last token in a 7th


async def ask(  # type: ignore[no-untyped-def]
    bus, worker_id: str = "", request_id: str = "r1", prompt: list[int] = PROMPT
) -> SubmitReply:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    req = SubmitRequest(request_id, "gw", pack_tokens(prompt), params, EOS, worker_id=worker_id)
    return decode(SubmitReply, await bus.request(SUBJECTS.submit_to("s1"), encode(req), 1))


async def test_the_g1_of_a_driven_worker_is_published_as_a_numbered_stream_and_dumped() -> None:
    """Eight prompts of 6 full blocks each through a worker of 32 blocks: the earlier ones are
    evicted. Replayed in order, the stream ends where the prefix cache is; so does the dump."""
    config = Config(scheduler_id="s1", kv_events_interval_s=0.02)
    async with running_service(config) as (service, bus, _worker, outputs):
        events: list[KVEvents] = []

        async def on_events(msg: Message) -> None:
            batch = decode(KVEvents, msg.data)
            if batch.publisher_id == "s1":
                events.append(batch)

        await bus.subscribe(SUBJECTS.kv_device_events, on_events)
        for i in range(8):
            prompt = [t + 100 * i for t in PROMPT]
            assert (await ask(bus, request_id=f"r{i}", prompt=prompt)).status is SubmitStatus.ACCEPTED
            while not any(o.finish_reason for o in (await asyncio.wait_for(outputs.get(), 2)).outputs):
                pass
        await asyncio.sleep(0.1)
        assert events, "no G1 events"
        first = events[0].seq  # seq 1 (empty) went out when the worker was claimed, before this
        assert [b.seq for b in events] == list(range(first, first + len(events)))
        assert {b.worker_id for b in events} == {"w1"}
        assert all(e.tier is CacheTier.DEVICE for b in events for e in b.events)
        held: set[bytes] = set()
        num_removed = 0
        for batch in events:
            for event in batch.events:
                hashes = split_hashes(event.block_hashes)
                if event.stored:
                    held.update(hashes)
                else:
                    held.difference_update(hashes)
                    num_removed += len(hashes)
        cache = service.workers["w1"].core.block_manager.prefix_cache
        assert held == set(cache.cached_hashes()) and num_removed > 0
        raw = await bus.request(SUBJECTS.kv_dump("s1"), encode(KVDumpRequest("s1", "w1")), 1)
        dump = decode(KVDump, raw)
        assert (dump.worker_id, dump.seq) == ("w1", events[-1].seq)
        assert set(split_hashes(dump.device_block_hashes)) == held


async def test_a_submit_is_placed_on_the_worker_the_router_named() -> None:
    async with running_service(Config(scheduler_id="s1")) as (service, bus, _worker, _outputs):
        second = ScriptedWorker(bus, "w2")
        await second.start()
        while "w2" not in service.workers:
            await asyncio.sleep(0.01)
        for i in range(3):  # by its own rule it would take w1 (equal, lowest id)
            assert (await ask(bus, "w2", f"r{i}")).status is SubmitStatus.ACCEPTED
        assert {service.fleet.worker_of(f"r{i}") for i in range(3)} <= {"w2", None}
        placed = [s.seq_id for plan in second.plans for s in plan.new_seqs]
        assert placed and set(placed) <= {"r0", "r1", "r2"}


async def test_a_free_worker_is_left_to_a_replica_driving_fewer_then_claimed_anyway(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(scheduler_service, "CLAIM_DEFER_S", 1.5)
    async with running_service(Config(scheduler_id="s1")) as (service, bus, _worker, _outputs):

        def s2_info() -> MemberInfo:
            return MemberInfo(MemberKind.SCHEDULER, "s2", num_workers=0)

        other = asyncio.create_task(announce(bus, SUBJECTS.members_bucket, s2_info, asyncio.Event()))
        deadline = time.monotonic() + 5
        while all(m.member_id != "s2" for m in service.members.live(MemberKind.SCHEDULER)):
            assert time.monotonic() < deadline, "s1 never saw s2"
            await asyncio.sleep(0.05)
        second = ScriptedWorker(bus, "w2")
        await second.start()
        started = time.monotonic()
        while "w2" not in service.workers:  # s2 (scripted) never claims it: s1 does, later
            await second.publish_load()
            await asyncio.sleep(0.1)
        assert time.monotonic() - started >= 1.4
        other.cancel()
