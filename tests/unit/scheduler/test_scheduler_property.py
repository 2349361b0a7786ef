"""Random arrivals, finishes and cancellations through the scheduler core and a fake worker.

The core runs inside LocalEngine, so the send/wait loop is the one the engine and the scheduler
service use (``WorkerScheduler.next_plan``). The KV pool is small so preemption happens often; plans run
with and without overlap (a second plan made before the first one's result). After every plan, every
result and every cancellation the core's and the fake worker's integrity hold, and every sequence
that finished on its own produced exactly what it produces running alone. With ``shared_prefixes``
prompts start with a prefix of one of a few texts under one of two tenants, so the prefix cache
hits (and evicts) all the time; the fake worker checks every position a hit lets it attend to.
With ``tiers`` the fake worker also keeps a small host memory (G2) and a store (G3): the core hears
of G2 through its events, late, sometimes not at all (then a dump replaces its view), and each
request starts with the G3 prefix the store holds, sometimes overstated; every load of a block the
worker no longer holds is recomputed, outputs must still be exact, and each sequence's usage counts
as cached only the tokens the worker did not compute. With ``pauses`` requests are paused (their
client left a stream) and resumed later, in any state: outputs must still be exact.
"""

from __future__ import annotations

import random

import pytest

from deepinfer.local_engine import LocalEngine
from libs.protocol.kv_messages import CacheTier
from libs.protocol.messages import FinishReason, SamplingParams
from services.scheduler.kv_tiers import TierStats
from services.scheduler.prefix_cache import PrefixCacheStats
from services.scheduler.sequence import Sequence
from services.scheduler.worker_scheduler import Limits
from tests.unit.scheduler.fake_worker import EOS, FakeRunner, FakeWorker, reference_output

BLOCK_SIZE = 4
NUM_BLOCKS = 40
MAX_MODEL_LEN = 96


SHARED_TEXTS = [[(7 * i + k) % 47 + 3 for i in range(32)] for k in range(3)]


def random_request(rng: random.Random, shared_prefixes: bool) -> tuple[list[int], SamplingParams, int]:
    prompt = [rng.randrange(3, 50) for _ in range(rng.randint(1, 40))]
    if shared_prefixes:
        prompt = rng.choice(SHARED_TEXTS)[: rng.randint(0, 32)] + prompt[: rng.randint(1, 8)]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=rng.randint(1, 30),
        min_tokens=rng.choice([0, 0, 3]),
        n=rng.choice([1, 1, 1, 2, 3]),
    )
    return prompt, params, rng.choice([0, 0, 1, 2])


def host_events(rng: random.Random, worker: FakeWorker, engine: LocalEngine) -> None:
    """Deliver the worker's G2 events to the core: mostly late, sometimes lost and then resynced
    by a dump; now and then the worker's G2 is cleared (a restart)."""
    core = engine.core
    if rng.random() < 0.02:
        worker.clear_host()
    if rng.random() < 0.5:
        return  # later
    events = worker.take_host_events()
    if rng.random() < 0.05:  # a gap: the core asks for a dump instead
        core.note_host_blocks(stored=list(worker.host), cleared=True)
    else:
        for stored, block_hashes in events:
            if stored:
                core.note_host_blocks(stored=block_hashes)
            else:
                core.note_host_blocks(removed=block_hashes, cleared=not block_hashes)
    core.check_integrity()


def num_stored_blocks(rng: random.Random, worker: FakeWorker, engine: LocalEngine, seq: Sequence) -> int:
    """What a G3 lookup says: the prefix of the prompt's chain in the store, sometimes overstated."""
    chain = engine.core.kv_tiers.prompt_chain(seq.prompt_token_ids, seq.tenant)
    n = next((i for i, h in enumerate(chain) if h not in worker.store), len(chain))
    return n + (rng.randint(1, 3) if rng.random() < 0.1 else 0)


def pause_or_resume(rng: random.Random, engine: LocalEngine, paused: set[str]) -> None:
    """Now and then pause a live request, or resume a paused one (always, once nothing else runs)."""
    core = engine.core
    if rng.random() < 0.05 and core.seqs:
        request_id = rng.choice(sorted(core.seqs)).split("#")[0]
        core.pause(request_id, deadline=0.0)  # never expired: expire_paused is not called
        paused.add(request_id)
        core.check_integrity()
    if paused and (rng.random() < 0.1 or not engine.has_work()):
        request_id = rng.choice(sorted(paused))
        paused.discard(request_id)
        core.resume(request_id)
        core.check_integrity()


def run(
    seed: int,
    overlap: bool,
    num_requests: int,
    shared_prefixes: bool = False,
    tiers: bool = False,
    pauses: bool = False,
) -> tuple[int, int, PrefixCacheStats, TierStats]:
    rng = random.Random(seed)
    limits = Limits(NUM_BLOCKS, BLOCK_SIZE, 8, MAX_MODEL_LEN, rng.choice([16, 32, 64]), 64, 0.01, True, tiers)
    runner = FakeRunner(BLOCK_SIZE, host_capacity=12)
    engine = LocalEngine(runner, limits, EOS, overlap=overlap, check=True)
    seqs: dict[str, Sequence] = {}
    num_added = num_checked = 0
    paused: set[str] = set()  # request ids
    while num_added < num_requests or engine.has_work() or paused:
        for _ in range(rng.choice([0, 0, 1, 2])):
            if num_added < num_requests and engine.core.num_waiting < 48:
                prompt, params, priority = random_request(rng, shared_prefixes)
                tenant = rng.choice(["", "t1"]) if shared_prefixes else ""
                for choice in engine.add(f"r{num_added}", prompt, params, priority, tenant):
                    seqs[choice.seq_id] = choice
                    if tiers:
                        choice.num_stored_blocks = num_stored_blocks(rng, runner.worker, engine, choice)
                num_added += 1
        if rng.random() < 0.05 and engine.core.seqs:
            victim = rng.choice(sorted(engine.core.seqs))
            assert all(s.finish_reason is FinishReason.ABORT for s in engine.abort(victim.split("#")[0]))
        if pauses:
            pause_or_resume(rng, engine, paused)
        engine.step()  # checks integrity after its plan and after its result
        if tiers:
            host_events(rng, runner.worker, engine)
    assert engine.core.block_manager.num_free_blocks == NUM_BLOCKS
    assert engine.finish_reasons.keys() == seqs.keys()
    for seq_id, reason in engine.finish_reasons.items():
        if reason is not FinishReason.ABORT:
            seq = seqs[seq_id]
            p = seq.sampling_params
            want = reference_output(seq.prompt_token_ids, p.max_tokens, MAX_MODEL_LEN, p.min_tokens)
            assert engine.outputs[seq_id] == want, seq_id
            if seq.index == 0:  # usage: what its first admission took from a cache, preempted
                # since or not (other choices share choice 0's prompt, which is no cache hit)
                assert seq.num_cached_tokens == runner.worker.first_reused[seq_id], seq_id
            num_checked += 1
    return num_checked, engine.num_preemptions, engine.core.prefix_cache_stats, engine.core.kv_tiers.stats


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_traffic_keeps_integrity_and_outputs(seed: int, overlap: bool) -> None:
    num_checked, num_preemptions, _, _ = run(seed, overlap, num_requests=1000)
    assert num_checked > 1000  # n > 1 requests add choices; a few are cancelled
    assert num_preemptions > 10  # the small pool forces recompute, so that path is exercised


@pytest.mark.parametrize("overlap", [False, True])
def test_random_traffic_with_shared_prefixes_hits_the_cache_and_keeps_outputs(overlap: bool) -> None:
    num_checked, _, stats, _ = run(2, overlap, num_requests=500, shared_prefixes=True)
    assert num_checked > 500
    assert stats.num_hit_tokens > stats.num_query_tokens // 4 and stats.num_evicted_blocks > 100


@pytest.mark.parametrize("overlap", [False, True])
def test_random_traffic_with_lower_tiers_loads_saves_and_keeps_outputs(overlap: bool) -> None:
    num_checked, _, g1, stats = run(3, overlap, num_requests=500, shared_prefixes=True, tiers=True)
    assert num_checked > 500
    assert stats.num_hit_tokens[CacheTier.HOST] > 0 and stats.num_hit_tokens[CacheTier.STORE] > 0
    assert stats.num_loaded_host_blocks > 0 and stats.num_loaded_store_blocks > 0
    assert stats.num_failed_load_blocks > 0  # stale hints happen, and cost only a recompute
    assert sum(stats.num_saved_blocks.values()) > 100 and g1.num_evicted_blocks > 100


@pytest.mark.parametrize("overlap", [False, True])
def test_random_traffic_with_pauses_and_resumes_keeps_integrity_and_outputs(overlap: bool) -> None:
    num_checked, _, stats, _ = run(
        4, overlap, num_requests=500, shared_prefixes=True, tiers=True, pauses=True
    )
    assert num_checked > 500
    assert stats.num_hit_tokens > 0
