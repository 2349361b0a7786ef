"""The gateway's KV router, pure: a prefix is found on whichever worker holds it (in G1, from its
scheduler's stream, or G2, from its own), a worker's removals stop it being preferred, a gap in a
stream empties that view and asks for a dump, the dump restores it, load and room weigh in, and
only the current owner's G1 counts. ``check_integrity`` runs after every operation."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from libs.kvstore.block_hash import hash_blocks
from libs.protocol.kv_messages import CacheTier, KVDump, KVEvent, KVEvents, RemovalReason, join_hashes
from libs.protocol.member_messages import WorkerLoad
from services.gateway.kv_router import KVRouter

BLOCK_SIZE = 4
MODEL = "m"
OWNERS = {"w0": "s1", "w1": "s1", "w2": "s2", "w3": "s2"}


def load(worker_id: str, running: int = 0, owner: str | None = None, **fields: Any) -> WorkerLoad:
    owner = OWNERS[worker_id] if owner is None else owner
    base = WorkerLoad(worker_id, running, 8, 4096, 256, BLOCK_SIZE, model=MODEL, owner=owner)
    return dataclasses.replace(base, **fields)


def chain(prompt: list[int], tenant: str = "") -> list[bytes]:
    num_blocks = (len(prompt) - 1) // BLOCK_SIZE
    return hash_blocks(prompt[: num_blocks * BLOCK_SIZE], BLOCK_SIZE, MODEL, tenant)


class Streams:
    """Numbers each stream's messages as its publisher would."""

    def __init__(self, router: KVRouter) -> None:
        self.router = router
        self.seq: dict[tuple[str, str], int] = {}

    def send(self, publisher: str, worker: str, stored: bool, hashes: list[bytes], skip: int = 0) -> object:
        key = (publisher, worker)
        self.seq[key] = self.seq.get(key, 0) + 1 + skip
        tier = CacheTier.DEVICE if worker else CacheTier.HOST
        reason = None if stored else RemovalReason.CAPACITY
        batch = KVEvents(
            publisher, self.seq[key], (KVEvent(tier, stored, join_hashes(hashes), reason),), MODEL, worker
        )
        need = self.router.on_events(batch)
        self.router.check_integrity()
        return need

    def g1(self, worker: str, stored: bool, hashes: list[bytes], skip: int = 0) -> object:
        return self.send(OWNERS[worker], worker, stored, hashes, skip)

    def g2(self, worker: str, stored: bool, hashes: list[bytes]) -> object:
        return self.send(worker, "", stored, hashes)


def fleet(**knobs: float) -> tuple[KVRouter, Streams]:
    router = KVRouter(rng=random.Random(0), **knobs)  # type: ignore[arg-type]
    for worker_id in OWNERS:
        router.on_load(load(worker_id), 0.0)
    router.check_integrity()
    return router, Streams(router)


def test_a_prefix_is_found_on_whichever_worker_holds_it_in_g1_or_g2() -> None:
    rng = random.Random(7)
    router, streams = fleet()
    for i in range(24):
        prompt = [rng.randrange(1000) for _ in range(41)]
        # Never the worker a hash of the prompt would pick: the router must look, not hash.
        by_hash = sorted(OWNERS)[hash(tuple(prompt)) % len(OWNERS)]
        holder = rng.choice([w for w in OWNERS if w != by_hash])
        (streams.g1 if i % 2 else streams.g2)(holder, True, chain(prompt))
        route = router.route(prompt, "", 1.0)
        router.check_integrity()
        assert route is not None and route.worker_id == holder, (i, route)
        assert (
            route.scheduler_id == OWNERS[holder] and route.num_cached_blocks == route.num_prompt_blocks == 10
        )
        router.on_load(load(holder), 1.0)  # its report: the routed request is running, not queued


def test_after_its_removals_a_worker_is_no_longer_preferred() -> None:
    router, streams = fleet()
    prompt = list(range(100, 141))
    streams.g1("w3", True, chain(prompt))
    streams.g2("w3", True, chain(prompt)[:4])
    assert router.route(prompt, "", 1.0).worker_id == "w3"  # type: ignore[union-attr]
    streams.g1("w3", False, chain(prompt))  # G1 evicted: G2 still holds the first 4 blocks
    route = router.route(prompt, "", 1.0)
    assert route is not None and (route.worker_id, route.num_cached_blocks) == ("w3", 4)
    streams.g2("w3", False, chain(prompt)[:4])
    for worker_id in OWNERS:
        router.on_load(load(worker_id), 2.0)
    route = router.route(prompt, "", 2.0)
    assert route is not None and (route.worker_id, route.num_cached_blocks) == (
        "w0",
        0,
    )  # nothing held: lowest id


def test_a_gap_empties_the_stream_asks_for_a_dump_and_the_dump_restores_it() -> None:
    router, streams = fleet()
    prompt = list(range(200, 241))
    blocks = chain(prompt)
    assert streams.g1("w2", True, blocks[:5]) is None
    assert streams.g1("w2", True, blocks[5:]) is None
    assert router.route(prompt, "", 1.0).worker_id == "w2"  # type: ignore[union-attr]
    need = streams.g1("w2", True, [], skip=1)  # seq 4 after 2: message 3 was lost
    assert need == ("s2", "w2")
    router.on_load(load("w2"), 1.0)
    route = router.route(prompt, "", 1.0)
    assert route is not None and route.worker_id != "w2"  # unknown now: never counted as held
    router.on_dump(KVDump("s2", 4, b"", "w2", join_hashes(blocks)))
    router.check_integrity()
    for worker_id in OWNERS:
        router.on_load(load(worker_id), 2.0)
    assert router.route(prompt, "", 2.0).worker_id == "w2"  # type: ignore[union-attr]
    late = KVEvents(
        "s2", 3, (KVEvent(CacheTier.DEVICE, False, join_hashes(blocks), RemovalReason.CAPACITY),), MODEL, "w2"
    )
    assert router.on_events(late) is None  # older than the dump: ignored
    assert router.route(prompt, "", 2.0).worker_id == "w2"  # type: ignore[union-attr]


def test_under_skew_no_worker_idles_while_the_holder_is_full() -> None:
    router, streams = fleet()
    prompt = list(range(300, 341))
    streams.g1("w1", True, chain(prompt))
    picks = [router.route(prompt, "", 1.0) for _ in range(20)]  # no load report comes between
    router.check_integrity()
    workers = [p.worker_id for p in picks if p is not None]
    assert workers[:8] == ["w1"] * 8  # the holder, until its 8 slots are taken
    assert set(workers[8:]) == {"w0", "w2", "w3"} and "w1" not in workers[8:12]


def test_load_weighs_against_cache_credit_and_temperature_spreads_equals() -> None:
    router, streams = fleet(load_weight=4.0)
    prompt = list(range(400, 441))
    streams.g1("w1", True, chain(prompt))
    router.on_load(load("w1", running=4), 1.0)  # half full: 4 * 0.5 outweighs a full hit (1.0)
    assert router.route(prompt, "", 1.0).worker_id == "w0"  # type: ignore[union-attr]
    router, _ = fleet(temperature=0.5)
    picks = {router.route([1, 2, 3], "", 1.0).worker_id for _ in range(40)}  # type: ignore[union-attr]
    assert len(picks) > 1  # equal costs: sampled, not always the lowest id


def test_only_routable_workers_and_only_the_current_owners_g1_count() -> None:
    router, streams = fleet()
    prompt = list(range(500, 541))
    streams.g1("w0", True, chain(prompt))
    router.on_load(load("w0", owner="s9"), 1.0)  # claimed by another scheduler: s1's G1 is gone
    router.check_integrity()
    route = router.route(prompt, "", 1.0)
    assert route is not None and route.num_cached_blocks == 0
    reports: list[tuple[str, dict[str, Any]]] = [
        ("w0", {"draining": True}),
        ("w1", {"role": "prefill"}),
        ("w2", {"owner": "s2"}),
    ]
    for worker_id, fields in reports:
        router.on_load(load(worker_id, **fields), 5.0)
    route = router.route(prompt, "", 5.0)  # w3 silent since 0.0 (> 3 s); w2 is the one left
    assert route is not None and route.worker_id == "w2"
    assert router.route(prompt, "", 20.0) is None and router.stats.num_unrouted == 1
    router.on_load(load("w3", owner=""), 20.0)  # unowned: any scheduler may claim it, none named
    assert router.route(prompt, "", 20.0) is None


def test_a_worker_silent_for_long_leaves_the_view_with_its_streams() -> None:
    router, streams = fleet()
    streams.g1("w0", True, chain(list(range(41))))
    streams.g2("w0", True, chain(list(range(41))))
    for worker_id in ("w1", "w2", "w3"):
        router.on_load(load(worker_id), 200.0)  # w0 last reported at 0.0
    router.check_integrity()
    assert "w0" not in router.workers
    assert ("s1", "w0") not in router.streams and ("w0", "") not in router.streams
