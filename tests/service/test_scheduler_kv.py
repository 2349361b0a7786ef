"""The scheduler service and the lower KV tiers: G3 lookups at kvcache, loads planned only for
workers that read the store, G2 events with gap -> dump, stats, routing bursts."""

from __future__ import annotations

import asyncio

from libs.bus.base import Message
from libs.bus.memory import InMemoryBus
from libs.kvstore.block_hash import hash_blocks
from libs.protocol.codec import decode, encode
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
    RequestOutput,
    StepOutputs,
    SubmitStatus,
)
from services.scheduler.config import Config
from tests.service.scheduler_harness import (
    BLOCK_SIZE,
    SUBJECTS,
    ScriptedWorker,
    running,
    running_service,
    submit,
)
from tests.unit.scheduler.fake_worker import reference_output


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


async def test_a_prompt_kvcache_holds_is_loaded_from_the_store(scheduler_stack) -> None:  # type: ignore[no-untyped-def]
    bus, worker, outputs = scheduler_stack
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


async def test_a_worker_without_the_store_gets_no_store_loads(scheduler_stack) -> None:  # type: ignore[no-untyped-def]
    bus, worker, outputs = scheduler_stack
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
