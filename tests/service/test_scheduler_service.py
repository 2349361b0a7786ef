"""The scheduler service on the in-memory bus, with a scripted stand-in on the worker's subjects
(and, for the lower KV tiers, on kvcache's lookup subject)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import pytest

from deepinfer.settings import build_config
from libs.bus.base import Message
from libs.bus.memory import InMemoryBus
from libs.kvstore.block_hash import hash_blocks
from libs.protocol.codec import decode, encode, pack_tokens, unpack_tokens
from libs.protocol.kv_messages import (
    CacheTier,
    KVCacheStats,
    KVDump,
    KVDumpRequest,
    KVEvent,
    KVEvents,
    KVLookup,
    KVLookupReply,
    join_hashes,
    split_hashes,
)
from libs.protocol.messages import (
    CancelRequest,
    FinishReason,
    ModelRunnerOutput,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
    StepOutputs,
    SubmitReply,
    SubmitRequest,
    SubmitStatus,
    WorkerLoad,
)
from libs.protocol.subjects import Subjects
from services.scheduler.config import Config
from services.scheduler.service import SchedulerService
from tests.unit.scheduler.fake_worker import EOS, FakeWorker, reference_output

PROMPT = [5, 6, 7]

SUBJECTS = Subjects()
BLOCK_SIZE = 4


class ScriptedWorker:
    """A FakeWorker (hash "model", KV checks) on the worker's subjects; records plans."""

    def __init__(
        self,
        bus: InMemoryBus,
        worker_id: str = "w1",
        max_num_seqs: int = 4,
        owner: str = "",
        has_kv_store: bool = True,
    ) -> None:
        self.bus = bus
        self.has_kv_store = has_kv_store
        self.worker_id = worker_id
        self.max_num_seqs = max_num_seqs
        self.owner = owner
        self.fake = FakeWorker(BLOCK_SIZE)
        self.plans: list[SchedulerOutput] = []
        self.gate = asyncio.Event()
        self.gate.set()

    @property
    def held(self) -> set[str]:
        return set(self.fake.seqs)

    async def start(self) -> None:
        await self.bus.subscribe(SUBJECTS.worker_step(self.worker_id), self.on_step)
        await self.publish_load()

    async def publish_load(self) -> None:
        load = WorkerLoad(self.worker_id, 0, self.max_num_seqs, 64, 32, BLOCK_SIZE, owner=self.owner)
        load = dataclasses.replace(load, has_kv_store=self.has_kv_store)
        await self.bus.publish(SUBJECTS.load(self.worker_id), encode(load))

    async def on_step(self, msg: Message) -> None:
        await self.gate.wait()
        plan = decode(SchedulerOutput, msg.data)
        self.plans.append(plan)
        ids, tokens = self.fake.execute(plan)
        host, store, failed = self.fake.last_loads
        out = ModelRunnerOutput(
            plan.step_id,
            ids,
            pack_tokens(tokens),
            len(self.fake.seqs),
            num_loaded_host_blocks=host,
            num_loaded_store_blocks=store,
            num_failed_load_blocks=failed,
        )
        await self.bus.respond(msg, encode(out))


Stack = tuple[InMemoryBus, ScriptedWorker, asyncio.Queue[StepOutputs]]


@contextlib.asynccontextmanager
async def running(config: Config) -> AsyncIterator[Stack]:
    """A scheduler service with ``config`` on an in-memory bus, one scripted worker, and the
    step outputs published to gateway "gw"."""
    async with running_service(config) as (_service, *stack):
        yield stack[0], stack[1], stack[2]


@contextlib.asynccontextmanager
async def running_service(
    config: Config,
) -> AsyncIterator[tuple[SchedulerService, InMemoryBus, ScriptedWorker, asyncio.Queue[StepOutputs]]]:
    bus = InMemoryBus()
    stop = asyncio.Event()
    service = SchedulerService(config, bus)
    task = asyncio.create_task(service.run(stop))
    await asyncio.sleep(0.01)
    worker = ScriptedWorker(bus)
    await worker.start()
    outputs: asyncio.Queue[StepOutputs] = asyncio.Queue()

    async def collect(msg: Message) -> None:
        outputs.put_nowait(decode(StepOutputs, msg.data))

    await bus.subscribe_durable(SUBJECTS.out("gw"), collect)
    await asyncio.sleep(0.01)
    yield service, bus, worker, outputs
    stop.set()
    await asyncio.wait_for(task, 5)
    await bus.close()


@pytest.fixture(params=[True, False], ids=["overlap", "no-overlap"])
async def stack(request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    async with running(Config(scheduler_id="s1", max_num_waiting=4, overlap=request.param)) as parts:
        yield parts


async def submit(
    bus: InMemoryBus,
    request_id: str,
    max_tokens: int = 3,
    n: int = 1,
    prompt: list[int] = PROMPT,
    tenant: str = "",
) -> SubmitReply:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)
    req = SubmitRequest(request_id, "gw", pack_tokens(prompt), params, EOS, tenant=tenant)
    return decode(SubmitReply, await bus.request(SUBJECTS.submit, encode(req), 1))


async def test_tokens_flow_in_order_one_message_per_step(stack) -> None:  # type: ignore[no-untyped-def]
    bus, _worker, outputs = stack
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


async def test_choices_arrive_with_their_index(stack) -> None:  # type: ignore[no-untyped-def]
    bus, _worker, outputs = stack
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


async def test_cached_prompt_tokens_are_reported_per_tenant(stack) -> None:  # type: ignore[no-untyped-def]
    bus, _worker, outputs = stack
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


async def test_the_worker_is_claimed_with_an_empty_plan(stack) -> None:  # type: ignore[no-untyped-def]
    _bus, worker, _outputs = stack
    first = worker.plans[0]
    assert first.scheduler_id == "s1" and first.num_scheduled_seqs == 0


async def test_cancel_reaches_the_worker_even_when_idle(stack) -> None:  # type: ignore[no-untyped-def]
    bus, worker, outputs = stack
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


# --- lower KV tiers -----------------------------------------------------------------------------


def stored_blocks(tokens: list[int], tenant: str = "") -> dict[bytes, tuple[int | None, ...]]:
    """The G3 blocks another worker saved for ``tokens`` (fingerprint "": the scripted worker's
    load names no model), with the KV the fake worker's slots hold for them."""
    hashes = hash_blocks(tokens, BLOCK_SIZE, "", tenant)
    return {
        h: tuple(hash(tuple(tokens[: i * BLOCK_SIZE + k + 1])) for k in range(BLOCK_SIZE))
        for i, h in enumerate(hashes)
    }


async def serve_kvcache(bus: InMemoryBus, worker: ScriptedWorker, lookups: list[KVLookup]) -> None:
    """kvcache's lookup: the longest prefix of the chain in the (fake worker's) store."""

    async def on_lookup(msg: Message) -> None:
        query = decode(KVLookup, msg.data)
        lookups.append(query)
        chain = split_hashes(query.block_hashes)
        n = next((i for i, h in enumerate(chain) if h not in worker.fake.store), len(chain))
        await bus.respond(msg, encode(KVLookupReply(n)))

    await bus.subscribe(SUBJECTS.kv_lookup, on_lookup)


async def run_to_end(outputs: asyncio.Queue[StepOutputs]) -> RequestOutput:
    while True:
        (out,) = (await asyncio.wait_for(outputs.get(), 2)).outputs
        if out.finish_reason is not None:
            return out


async def test_a_prompt_kvcache_holds_is_loaded_from_the_store(stack) -> None:  # type: ignore[no-untyped-def]
    bus, worker, outputs = stack
    prompt = list(range(20, 30))  # 2 full blocks, then the last token's
    worker.fake.store.update(stored_blocks(prompt[:8], tenant="acme"))
    lookups: list[KVLookup] = []
    await serve_kvcache(bus, worker, lookups)
    assert (await submit(bus, "r1", prompt=prompt, tenant="acme")).status is SubmitStatus.ACCEPTED
    assert (await run_to_end(outputs)).num_cached_tokens == 8  # the fake checked the loaded KV
    assert split_hashes(lookups[0].block_hashes) == hash_blocks(prompt[:8], BLOCK_SIZE, "", "acme")
    (new,) = [n for plan in worker.plans for n in plan.new_seqs]
    assert new.kv_load is not None and new.kv_load.tiers == bytes([CacheTier.STORE] * 2)
    assert new.num_computed_tokens == 8
    # the end of the output is saved in the plan after the finish: its third block reaches G3
    full = prompt + reference_output(prompt, 3, 64, ignore_eos=True)
    third = hash_blocks(full, BLOCK_SIZE, "", "acme")[2]
    for _ in range(100):
        if third in worker.fake.store:
            break
        await asyncio.sleep(0.01)
    assert third in worker.fake.store


async def test_a_worker_without_the_store_gets_no_store_loads(stack) -> None:  # type: ignore[no-untyped-def]
    bus, worker, outputs = stack
    worker.has_kv_store = False  # started with G3 off (the store others share is not its)
    await worker.publish_load()
    prompt = list(range(20, 30))
    worker.fake.store.update(stored_blocks(prompt[:8]))
    lookups: list[KVLookup] = []
    await serve_kvcache(bus, worker, lookups)
    await asyncio.sleep(0.01)
    assert (await submit(bus, "r1", prompt=prompt)).status is SubmitStatus.ACCEPTED
    assert (await run_to_end(outputs)).num_cached_tokens == 0
    assert lookups == []  # nobody asked kvcache for a worker that could not read what it holds
    assert all(n.kv_load is None for plan in worker.plans for n in plan.new_seqs)


async def test_host_events_with_a_gap_are_resynced_by_a_dump() -> None:
    config = Config(scheduler_id="s1", kv_stats_interval_s=0.02)
    async with running_service(config) as (service, bus, _worker, _outputs):
        hashes = hash_blocks(list(range(40, 56)), BLOCK_SIZE, "", "")  # 4 blocks
        dumps: list[KVDumpRequest] = []

        async def on_dump(msg: Message) -> None:
            dumps.append(decode(KVDumpRequest, msg.data))
            await bus.respond(msg, encode(KVDump("w1", 5, join_hashes(hashes[:3]))))

        await bus.subscribe(SUBJECTS.kv_dump("w1"), on_dump)

        async def events(seq: int, stored: bool, block_hashes: list[bytes]) -> None:
            batch = KVEvents("w1", seq, (KVEvent(CacheTier.HOST, stored, join_hashes(block_hashes)),))
            await bus.publish(SUBJECTS.kv_events, encode(batch))
            await asyncio.sleep(0.02)

        tiers = service.workers["w1"].core.kv_tiers
        await events(1, True, hashes[:1])
        await events(2, True, hashes[1:2])
        assert tiers.num_host_blocks == 2 and dumps == []
        await events(4, True, hashes[3:4])  # seq 3 was lost: the scheduler asks for a dump
        assert dumps == [KVDumpRequest("w1")] and tiers.num_host_blocks == 3
        await events(5, False, hashes[:3])  # the dump (as of seq 5) covers it: ignored
        assert tiers.num_host_blocks == 3
        await events(6, False, hashes[:1])
        assert tiers.num_reusable_blocks(hashes) == 0 and tiers.num_host_blocks == 2
        # another worker's events leave this one's view alone
        other = KVEvents("w9", 1, (KVEvent(CacheTier.HOST, True, join_hashes(hashes)),))
        await bus.publish(SUBJECTS.kv_events, encode(other))
        await asyncio.sleep(0.02)
        assert tiers.num_host_blocks == 2
        stats = asyncio.Queue[KVCacheStats]()

        async def collect(msg: Message) -> None:
            stats.put_nowait(decode(KVCacheStats, msg.data))

        await bus.subscribe(SUBJECTS.stats("scheduler", "s1"), collect)
        published = await asyncio.wait_for(stats.get(), 2)
        assert published.publisher_id == "s1" and published.kind == "scheduler"
        assert {(c.name, c.label) for c in published.counters} >= {("hit_tokens", "G2"), ("saves", "all")}


async def test_a_silent_kvcache_never_fails_a_submit() -> None:
    config = Config(scheduler_id="s1", kv_lookup_timeout_s=0.01)
    async with running(config) as (bus, _worker, outputs):

        async def never(msg: Message) -> None:
            await asyncio.sleep(10)

        await bus.subscribe(SUBJECTS.kv_lookup, never)
        prompt = list(range(20, 30))
        assert (await submit(bus, "r1", prompt=prompt)).status is SubmitStatus.ACCEPTED
        assert (await run_to_end(outputs)).num_cached_tokens == 0


async def test_a_burst_of_submits_spreads_over_the_workers() -> None:
    # Every lookup is in flight at once: a worker picked before its answer would take the burst.
    async with running_service(Config(scheduler_id="s1", kv_lookup_timeout_s=5)) as (service, bus, w1, _):
        w2 = ScriptedWorker(bus, "w2")
        await w2.start()
        await asyncio.sleep(0.01)
        w1.gate.clear()  # nothing finishes during the burst
        w2.gate.clear()
        held: list[Message] = []

        async def answer_when_all_came(msg: Message) -> None:
            held.append(msg)
            if len(held) == 8:
                for lookup_msg in held:
                    await bus.respond(lookup_msg, encode(KVLookupReply(0)))

        await bus.subscribe(SUBJECTS.kv_lookup, answer_when_all_came)
        prompt = list(range(20, 30))
        replies = await asyncio.gather(*(submit(bus, f"r{i}", prompt=prompt) for i in range(8)))
        assert all(r.status is SubmitStatus.ACCEPTED for r in replies) and len(held) == 8
        assert {wid: len(h.core.seqs) for wid, h in service.workers.items()} == {"w1": 4, "w2": 4}
        w1.gate.set()
        w2.gate.set()
