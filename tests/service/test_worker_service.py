"""The worker service on the in-memory bus with a tiny random-weight model: steps, load, ownership,
and with KV tiers: events in sequence, G2 dumps (answered while a step runs), stats, the model
fingerprint."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from libs.bus.base import Message
from libs.bus.memory import InMemoryBus
from libs.kvstore.block_file import BlockLayout
from libs.kvstore.block_hash import hash_blocks
from libs.models.llama import LlamaForCausalLM
from libs.protocol.codec import decode, encode, pack_tokens
from libs.protocol.kv_messages import (
    CacheTier,
    KVCacheStats,
    KVDump,
    KVDumpRequest,
    KVEvent,
    KVEvents,
    KVLoad,
    KVSave,
    PartialSave,
    RemovalReason,
    join_hashes,
)
from libs.protocol.member_messages import WorkerLoad
from libs.protocol.messages import ModelRunnerOutput, NewSequence, SamplingParams, SchedulerOutput
from libs.protocol.subjects import Subjects
from services.worker.config import Config
from services.worker.handoff_area import HANDOFF_DIR_NAME, HandoffArea
from services.worker.host_cache import HostCache
from services.worker.kv_store import KVStore
from services.worker.kv_tiers import KVTiers
from services.worker.model_runner import ModelRunner, ModelShape
from services.worker.service import WorkerService
from services.worker.step_profile import DRAFT_LENGTHS, profile_steps
from tests.tiny_models import TINY_LLAMA

SUBJECTS = Subjects()


def make_service(bus: InMemoryBus, orphan_timeout_s: float) -> WorkerService:
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY_LLAMA).eval()
    runner = ModelRunner(model, ModelShape.of(TINY_LLAMA), 16, 4, torch.float32)
    # No drain: these tests stop with sequences held (tests/service/test_worker_drain.py drains).
    config = Config(
        worker_id="w1", orphan_timeout_s=orphan_timeout_s, load_interval_s=3600, drain_timeout_s=0
    )
    return WorkerService(config, bus, runner, max_model_len=64, model_name="tiny")


def test_the_load_report_carries_the_start_up_profile() -> None:
    torch.manual_seed(0)
    runner = ModelRunner(LlamaForCausalLM(TINY_LLAMA).eval(), ModelShape.of(TINY_LLAMA), 96, 4, torch.float32)
    profile = profile_steps(runner, max_num_seqs=4)
    assert len(profile) == 2 * (1 + len(DRAFT_LENGTHS))  # 1 and 4 rows, without and with drafts
    config = Config(worker_id="w1", load_interval_s=3600)
    service = WorkerService(config, InMemoryBus(), runner, 64, "tiny", step_profile=profile)
    assert decode(WorkerLoad, encode(service.load())).step_profile == profile


def plan(step_id: int, scheduler_id: str, seq_id: str, block: int) -> bytes:
    params = SamplingParams(temperature=0.0)
    new = NewSequence(seq_id, pack_tokens([3, 4, 5]), b"", params, (2,), pack_tokens([block]), 0, 3)
    return encode(SchedulerOutput(step_id, (new,), scheduler_id=scheduler_id))


async def step(bus: InMemoryBus, data: bytes) -> ModelRunnerOutput:
    return decode(ModelRunnerOutput, await bus.request(SUBJECTS.worker_step("w1"), data, 5))


async def test_owner_steps_others_are_refused_and_a_silent_owner_is_released() -> None:
    bus = InMemoryBus()
    service = make_service(bus, orphan_timeout_s=0.2)
    loads: list[WorkerLoad] = []

    async def on_load(msg: Message) -> None:
        loads.append(decode(WorkerLoad, msg.data))

    await bus.subscribe(SUBJECTS.load("w1"), on_load)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await asyncio.sleep(0.01)
    out = await step(bus, plan(1, "s1", "a", block=0))
    assert out.seq_ids == ("a",) and out.num_running_seqs == 1 and not out.error
    assert loads[-1].owner == "s1" and loads[-1].num_kv_blocks == 16 and loads[-1].block_size == 4
    refused = await step(bus, plan(1, "s2", "b", block=1))
    assert "owned by scheduler s1" in refused.error and set(service.runner.seqs) == {"a"}
    assert await service.drop_orphans() == 0  # s1 just spoke
    await asyncio.sleep(0.3)  # s1 is now silent for longer than the timeout while holding "a"
    assert await service.drop_orphans() == 1
    assert service.owner == "" and service.runner.seqs == {}
    out = await step(bus, plan(1, "s2", "b", block=1))
    assert out.seq_ids == ("b",) and service.owner == "s2"
    service.runner.check_integrity()
    bad = await bus.request(SUBJECTS.worker_step("w1"), b"\x00garbage", 5)
    assert decode(ModelRunnerOutput, bad).error
    stop.set()
    await asyncio.wait_for(task, 5)
    await bus.close()


async def test_every_forward_runs_on_one_thread() -> None:
    """The OpenMP runtime keeps a team of threads per calling thread: forwards must not wander
    over the default executor's threads (here one is kept busy between two steps, which sent the
    second step to another thread before the worker had a step thread of its own)."""
    bus = InMemoryBus()
    service = make_service(bus, orphan_timeout_s=60)
    threads: list[int] = []
    execute = service.runner.execute

    def recording(plan: SchedulerOutput) -> ModelRunnerOutput:
        threads.append(threading.get_ident())
        return execute(plan)

    service.runner.execute = recording  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await asyncio.sleep(0.01)
    assert not (await step(bus, plan(1, "s1", "a", block=0))).error
    busy = asyncio.create_task(asyncio.to_thread(time.sleep, 0.3))  # the default executor's idle thread
    await asyncio.sleep(0.05)
    assert not (await step(bus, plan(2, "s1", "b", block=1))).error
    await busy
    assert len(threads) == 2 and threads[0] == threads[1] != threading.get_ident()
    stop.set()
    await asyncio.wait_for(task, 5)
    await bus.close()


FP = "tiny-0123456789abcdef"
PROMPT = [3, 4, 5, 6, 7, 8, 9, 10, 11]  # 2 full blocks of 4, then 1 token
HASHES = hash_blocks(PROMPT, 4, FP)


def make_tiered_service(bus: InMemoryBus, root: Path) -> WorkerService:
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY_LLAMA).eval()
    shape = ModelShape.of(TINY_LLAMA)
    host = HostCache(8, shape.kv_spec.block_shape(4), torch.float32)
    store = KVStore(root, FP, BlockLayout(shape.kv_spec, 4), torch.float32)
    handoff = HandoffArea(root / HANDOFF_DIR_NAME, FP, store.layout, torch.float32, max_age_s=100)
    runner = ModelRunner(model, shape, 16, 4, torch.float32, kv_tiers=KVTiers(host, store), handoff=handoff)
    config = Config(worker_id="w1", load_interval_s=3600, drain_timeout_s=0)
    return WorkerService(config, bus, runner, max_model_len=64, model_name="tiny", model_fingerprint=FP)


def new_seq(seq_id: str, blocks: list[int], kv_load: KVLoad | None = None) -> NewSequence:
    num_computed = 8 if kv_load is not None else 0
    params = SamplingParams(temperature=0.0)
    return NewSequence(
        seq_id,
        pack_tokens(PROMPT),
        b"",
        params,
        (2,),
        pack_tokens(blocks),
        num_computed,
        9 - num_computed,
        kv_load,
    )


async def until(condition: Callable[[], bool]) -> None:
    """Wait for messages published after a reply (events, loads); fails after 5 s of nothing."""
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0.005)


async def test_kv_events_in_sequence_dumps_stats_and_fingerprint(tmp_path: Path) -> None:
    bus = InMemoryBus()
    service = make_tiered_service(bus, tmp_path)
    events: list[KVEvents] = []
    loads: list[WorkerLoad] = []
    stats: list[KVCacheStats] = []

    async def on_events(msg: Message) -> None:
        events.append(decode(KVEvents, msg.data))

    async def on_load(msg: Message) -> None:
        loads.append(decode(WorkerLoad, msg.data))

    async def on_stats(msg: Message) -> None:
        stats.append(decode(KVCacheStats, msg.data))

    await bus.subscribe(SUBJECTS.kv_events, on_events)
    await bus.subscribe(SUBJECTS.load("w1"), on_load)
    await bus.subscribe(SUBJECTS.stats("worker", "w1"), on_stats)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await until(lambda: bool(events and loads and stats))
    assert events[0] == KVEvents("w1", 1, (KVEvent(CacheTier.HOST, False, b"", RemovalReason.CLEARED),), FP)
    assert loads[-1].model_fingerprint == FP
    assert stats[0].publisher_id == "w1" and stats[0].kind == "worker" and stats[0].counters

    assert not (
        await step(bus, encode(SchedulerOutput(1, (new_seq("a", [0, 1, 2]),), scheduler_id="s1")))
    ).error
    save = KVSave(pack_tokens([0, 1]), join_hashes(HASHES), "chat")
    out = await step(
        bus, encode(SchedulerOutput(2, finished_seq_ids=("a",), kv_saves=(save,), scheduler_id="s1"))
    )
    assert not out.error
    await until(lambda: len(events) >= 2)
    assert events[1].seq == 2 and events[1].events[0] == KVEvent(
        CacheTier.HOST, True, join_hashes(HASHES), num_bytes=2048
    )

    assert service.runner.kv_tiers is not None
    service.runner.kv_tiers.flush()  # the G3 writes, published with the next message
    plan = SchedulerOutput(3, (new_seq("b", [5, 6, 7], KVLoad(0, join_hashes(HASHES))),), scheduler_id="s1")
    decode_b = SchedulerOutput(4, (), ("b",), pack_tokens([1]), (b"",), scheduler_id="s1")
    # sent back to back, as overlap scheduling does: the second waits for the first, in order
    out, then = await asyncio.gather(step(bus, encode(plan)), step(bus, encode(decode_b)))
    assert out.num_loaded_host_blocks == 2 and out.num_failed_load_blocks == 0 and out.seq_ids == ("b",)
    assert not then.error and then.seq_ids == ("b",)

    def store_events() -> list[KVEvent]:  # the writer thread's: they go with whichever message follows
        return [e for m in events for e in m.events if e.tier is CacheTier.STORE]

    await until(lambda: len(store_events()) == 2)
    stored = store_events()
    assert [e.block_hashes for e in stored] == HASHES and all(e.retention_class == "chat" for e in stored)

    dump = decode(KVDump, await bus.request(SUBJECTS.kv_dump("w1"), encode(KVDumpRequest("s1")), 5))
    assert dump == KVDump("w1", service.kv_seq, join_hashes(HASHES))
    await until(lambda: events[-1].seq == dump.seq)  # every event up to the dump was published
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    service.runner.check_integrity()
    service.runner.kv_tiers.check_integrity()
    stop.set()
    await asyncio.wait_for(task, 5)
    service.runner.kv_tiers.close()
    await bus.close()


async def running_with_a_sequence(
    bus: InMemoryBus, root: Path
) -> tuple[WorkerService, list[KVEvents], asyncio.Event, asyncio.Task[None]]:
    """A tiered worker running (until ``stop``), its KV events collected, sequence "a" computed."""
    service = make_tiered_service(bus, root)
    events: list[KVEvents] = []

    async def on_events(msg: Message) -> None:
        events.append(decode(KVEvents, msg.data))

    await bus.subscribe(SUBJECTS.kv_events, on_events)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await until(lambda: bool(events))
    assert not (
        await step(bus, encode(SchedulerOutput(1, (new_seq("a", [0, 1, 2]),), scheduler_id="s1")))
    ).error
    return service, events, stop, task


async def test_a_finished_g3_write_is_announced_at_once(tmp_path: Path) -> None:
    """The completion notice a P/D handoff waits for: the store's writer thread finishes the
    writes of a save after the step that asked for them, and their events go out then, with no
    step after it and no load report due (its period is an hour here)."""
    bus = InMemoryBus()
    service, events, stop, task = await running_with_a_sequence(bus, tmp_path)
    save = KVSave(pack_tokens([0, 1]), join_hashes(HASHES), "chat")
    plan = SchedulerOutput(2, finished_seq_ids=("a",), kv_saves=(save,), scheduler_id="s1")
    assert not (await step(bus, encode(plan))).error
    async with asyncio.timeout(5):
        while True:
            written = [
                e.block_hashes for m in events for e in m.events if e.tier is CacheTier.STORE and e.stored
            ]
            if len(written) == 2:
                break
            await asyncio.sleep(0.01)
    assert written == HASHES
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    stop.set()
    await asyncio.wait_for(task, 5)
    assert service.runner.kv_tiers is not None
    service.runner.kv_tiers.close()
    await bus.close()


async def test_a_partial_block_s_write_is_announced_and_a_stale_file_swept(tmp_path: Path) -> None:
    """A handoff's partial block (page 2 holds PROMPT's 9th token) goes to the handoff area, and
    its notice out in a KV events message at once; a file older than the area's bound, left by a
    worker that died, is deleted when the worker starts."""
    stale = tmp_path / HANDOFF_DIR_NAME / FP / f"{'ab' * 32}.kvb"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"left by a dead worker")
    os.utime(stale, (time.time() - 1000, time.time() - 1000))
    bus = InMemoryBus()
    service, events, stop, task = await running_with_a_sequence(bus, tmp_path)
    assert service.load().has_handoff_area
    key = bytes(range(32))
    plan = SchedulerOutput(
        2, finished_seq_ids=("a",), partial_saves=(PartialSave(2, key),), scheduler_id="s1"
    )
    assert not (await step(bus, encode(plan))).error
    await until(lambda: any(m.handoff_keys == key for m in events))
    handoff = service.runner.transfer.handoff
    assert handoff is not None and handoff.path(key).is_file() and not stale.exists()
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    drop = SchedulerOutput(3, handoff_drops=key, scheduler_id="s1")
    assert not (await step(bus, encode(drop))).error
    await until(lambda: not handoff.path(key).exists())
    stop.set()
    await asyncio.wait_for(task, 5)
    assert service.runner.kv_tiers is not None
    service.runner.kv_tiers.close()
    handoff.close()
    await bus.close()


async def test_a_dump_is_answered_while_a_step_runs(tmp_path: Path) -> None:
    """A step that saved blocks to G2 and has not finished yet: the dump has them, with the seq of
    the last message published; their event comes after it, and re-applying it changes nothing."""
    bus = InMemoryBus()
    service, events, stop, task = await running_with_a_sequence(bus, tmp_path)
    await until(lambda: events[-1].seq == service.kv_seq)
    seq_before = service.kv_seq
    # The G3 writes' notices would send the G2 event too, mid-step: this test holds it in the
    # outbox until the step ends, to check a dump taken meanwhile.
    assert service.runner.kv_tiers is not None
    service.runner.kv_tiers.on_written = None

    inside, release = threading.Event(), threading.Event()
    execute = service.runner.execute

    def held_execute(plan: SchedulerOutput) -> ModelRunnerOutput:
        out = execute(plan)  # G2 holds the saved blocks from here on
        inside.set()
        release.wait(10)  # a long step: the dump must not wait for it
        return out

    service.runner.execute = held_execute  # type: ignore[method-assign]
    save = KVSave(pack_tokens([0, 1]), join_hashes(HASHES), "chat")
    plan = SchedulerOutput(2, finished_seq_ids=("a",), kv_saves=(save,), scheduler_id="s1")
    running = asyncio.create_task(step(bus, encode(plan)))
    await until(inside.is_set)
    try:
        data = await bus.request(SUBJECTS.kv_dump("w1"), encode(KVDumpRequest("s1")), 5)
        assert not running.done()
    finally:
        release.set()
    assert decode(KVDump, data) == KVDump("w1", seq_before, join_hashes(HASHES))
    assert not (await running).error
    await until(lambda: events[-1].seq == seq_before + 1)
    assert KVEvent(CacheTier.HOST, True, join_hashes(HASHES), num_bytes=2048) in events[-1].events
    stop.set()
    await asyncio.wait_for(task, 5)
    assert service.runner.kv_tiers is not None
    service.runner.kv_tiers.close()
    await bus.close()
