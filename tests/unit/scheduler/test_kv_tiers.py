"""The lower KV tiers in the scheduler core, driven by the fake worker (which keeps a G2 and a G3
and checks every position a sequence attends to): admission extends a G1 hit with G2 and G3
blocks as a KVLoad, store points put the right saves in the next plan (also with a second plan
in flight, on abort, and in a plan that carries nothing else), stale hints only cost a recompute,
and routing prefers the worker holding the prefix unless it is full.

A second core on the same fake worker stands for G1 lost (a scheduler restart, or eviction) while
the worker's host memory and the store keep their blocks.
"""

from __future__ import annotations

import pytest

from libs.kvstore.block_hash import hash_blocks
from libs.kvstore.event_cursor import EventCursor, EventVerdict
from libs.protocol.codec import unpack_tokens
from libs.protocol.kv_messages import CacheTier, split_hashes
from libs.protocol.messages import NewSequence, SamplingParams, SchedulerOutput
from services.scheduler.router import WorkerState, pick_in_turn, pick_worker
from services.scheduler.sequence import Sequence
from services.scheduler.worker_scheduler import Limits, WorkerScheduler
from tests.unit.scheduler.driver import Driver
from tests.unit.scheduler.fake_worker import EOS, FakeWorker, reference_output

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
TEXT = list(range(10, 30))  # five full blocks
FP = "tiny"


def make_scheduler(num_blocks: int = 64, tiers: bool = True) -> WorkerScheduler:
    limits = Limits(num_blocks, BLOCK_SIZE, 4, MAX_MODEL_LEN, 256, 16, 0.0, True, tiers)
    return WorkerScheduler(limits, model_fingerprint=FP)


def make_seq(
    seq_id: str, prompt: list[int], max_tokens: int = 3, num_stored_blocks: int = 0, retention: str = ""
) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seq = Sequence(seq_id, "gw", list(prompt), params, EOS, retention_class=retention)
    seq.num_stored_blocks = num_stored_blocks
    return seq


def chain(tokens: list[int]) -> list[bytes]:
    return hash_blocks(tokens, BLOCK_SIZE, FP)


def saved(plan: SchedulerOutput) -> list[tuple[list[int], list[bytes], str]]:
    return [
        (unpack_tokens(s.block_ids), split_hashes(s.block_hashes), s.retention_class) for s in plan.kv_saves
    ]


def dump_host(worker: FakeWorker, sched: WorkerScheduler) -> None:
    """What a KVDump does: the core's G2 view becomes what the worker's G2 holds."""
    sched.note_host_blocks(stored=list(worker.host), cleared=True)
    worker.take_host_events()


def warm_worker(prompt: list[int], max_tokens: int = 3) -> FakeWorker:
    """A worker whose G2 and G3 hold ``prompt``'s full blocks (served by a core now gone)."""
    driver = Driver(make_scheduler())
    driver.serve(make_seq("warm", prompt, max_tokens))
    return driver.worker


def tiers_of(new: NewSequence) -> list[CacheTier]:
    assert new.kv_load is not None
    return [CacheTier(t) for t in new.kv_load.tiers]


def test_a_prompt_in_host_memory_is_loaded_not_computed() -> None:
    worker = warm_worker([*TEXT[:8], 1, 2], max_tokens=2)  # 2 full blocks saved, in G2 and G3
    sched = make_scheduler()
    dump_host(worker, sched)  # the new core learns what the worker's G2 holds
    assert sched.kv_tiers.num_host_blocks == 2
    seq = make_seq("a", [*TEXT[:8], 5, 6, 7])
    new = Driver(sched, worker).serve(seq)
    assert new.kv_load is not None and new.kv_load.first_block == 0
    assert split_hashes(new.kv_load.block_hashes) == chain(TEXT[:8])
    assert tiers_of(new) == [CacheTier.HOST, CacheTier.HOST]
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (8, 3)
    assert seq.num_cached_tokens == 8
    stats = sched.kv_tiers.stats
    assert stats.num_hit_tokens == {CacheTier.DEVICE: 0, CacheTier.HOST: 8, CacheTier.STORE: 0}
    assert (stats.num_queries, stats.num_query_tokens, stats.num_loaded_host_blocks) == (1, 11, 2)
    counters = sched.kv_tiers.counters()
    assert counters["hit_tokens", "G2"] == 8 and counters["planned_load_blocks", "G2"] == 2


def test_a_prompt_in_the_store_is_loaded_and_g1_g2_g3_compose() -> None:
    prompt = [*TEXT[:16], 1]  # 4 full blocks
    worker = warm_worker(prompt)
    worker.clear_host()  # G2 lost (a restart): only G3 has the blocks
    sched = make_scheduler()
    driver = Driver(sched, worker)
    driver.serve(make_seq("g1", [*TEXT[:4], 99]))  # G1 now holds block 0 (computed here, not loaded)
    assert driver.plans[0].new_seqs[0].kv_load is None
    worker.host[chain(TEXT[:8])[1]] = worker.store[chain(TEXT[:8])[1]]  # and G2 block 1
    sched.note_host_blocks(stored=[chain(TEXT[:8])[1]])
    seq = make_seq("mixed", prompt, num_stored_blocks=3)  # the lookup said: G3 holds blocks 0..2
    new = driver.serve(seq)
    assert new.kv_load is not None and new.kv_load.first_block == 1
    assert split_hashes(new.kv_load.block_hashes) == chain(prompt)[1:3]
    assert tiers_of(new) == [CacheTier.HOST, CacheTier.STORE]
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (12, 5)
    assert seq.num_cached_tokens == 12
    hits = sched.kv_tiers.stats.num_hit_tokens
    assert (hits[CacheTier.DEVICE], hits[CacheTier.HOST], hits[CacheTier.STORE]) == (4, 4, 4)
    stats = sched.kv_tiers.stats
    loaded = (stats.num_loaded_host_blocks, stats.num_loaded_store_blocks, stats.num_failed_load_blocks)
    assert loaded == (1, 1, 0)
    # After a G1 hit too, the blocks it loaded are not saved again (its own computed ones are).
    saves = [split_hashes(save.block_hashes) for plan in driver.plans[1:] for save in plan.kv_saves]
    assert saves and not {h for save in saves for h in save} & set(chain(prompt)[1:3])


def test_loaded_blocks_enter_g1_from_the_next_plan() -> None:
    worker = warm_worker([*TEXT[:8], 1])
    sched = make_scheduler()
    dump_host(worker, sched)
    driver = Driver(sched, worker)
    sched.add(make_seq("a", [*TEXT[:8], 2], max_tokens=5))
    sched.add(make_seq("b", [*TEXT[:8], 3], max_tokens=5))  # same plan: loads too, no G1 hit yet
    driver.step()
    sched.add(make_seq("c", [*TEXT[:8], 4]))  # a later plan: G1 has a's loaded blocks
    driver.run()
    loads = {new.seq_id: new.kv_load for plan in driver.plans for new in plan.new_seqs}
    assert loads["a"] is not None and loads["b"] is not None and loads["c"] is None
    assert sched.kv_tiers.stats.num_hit_tokens[CacheTier.DEVICE] == 8


def test_blocks_loaded_from_g3_are_not_saved_again() -> None:
    """G3 hits reach G2 as the worker loads them; saving them once more would copy them out of G1
    a second time (a P/D handoff's whole prompt). Only the blocks computed here are saved."""
    prompt = [*TEXT[:8], 1]
    worker = warm_worker(prompt)
    worker.clear_host()  # only G3 has the blocks
    sched = make_scheduler()
    driver = Driver(sched, worker, events=False)  # (no HOST event tells the scheduler of the G2 copy)
    longer = [*prompt, *TEXT[9:13]]  # 3 full blocks, and 1 token
    new = driver.serve(make_seq("a", longer, max_tokens=4, num_stored_blocks=2))
    assert new.kv_load is not None and tiers_of(new) == [CacheTier.STORE, CacheTier.STORE]
    saved = [h for plan in driver.plans for save in plan.kv_saves for h in split_hashes(save.block_hashes)]
    # prompt block 2 at the prompt's end, block 3 (with the output) at the finish; 0 and 1 never
    assert len(saved) == 2 and saved[0] == chain(longer)[2]
    sched.check_integrity()


def test_a_stale_hint_is_recomputed_by_the_worker() -> None:
    sched = make_scheduler()
    sched.note_host_blocks(stored=chain(TEXT[:8]))  # the worker's G2 lost them since
    seq = make_seq("a", [*TEXT[:8], 1], num_stored_blocks=2)
    driver = Driver(sched)
    new = driver.serve(seq)  # the fake checks the recomputed KV like any other
    assert new.num_computed_tokens == 8 and tiers_of(new) == [CacheTier.HOST, CacheTier.HOST]
    stats = sched.kv_tiers.stats
    assert (stats.num_failed_load_blocks, stats.num_planned_blocks[CacheTier.HOST]) == (2, 2)
    assert stats.num_hit_tokens[CacheTier.HOST] == 0  # planned, not served
    assert seq.num_cached_tokens == 0  # usage counts what came from a cache
    # The recomputed blocks are in no tier: saved once, after the step that recomputed them.
    saved = [h for plan in driver.plans for save in plan.kv_saves for h in split_hashes(save.block_hashes)]
    assert saved == chain(TEXT[:8])
    sched.check_integrity()


def test_store_points_save_the_prompt_then_the_output_in_the_next_plan() -> None:
    sched = make_scheduler()
    driver = Driver(sched, events=False)
    prompt = TEXT[:6]  # one full prompt block
    driver.serve(make_seq("a", prompt, max_tokens=7, retention="chat"))  # 13 tokens, 12 computed
    assert driver.plans[0].kv_saves == ()
    table = unpack_tokens(driver.plans[0].new_seqs[0].block_ids) + [
        b for plan in driver.plans[1:] for ids in plan.new_block_ids for b in unpack_tokens(ids)
    ]
    hashes = chain(prompt + reference_output(prompt, 7, 64, ignore_eos=True))
    assert saved(driver.plans[1]) == [([table[0]], hashes[:1], "chat")]  # the end of the user input
    assert all(p.kv_saves == () for p in driver.plans[2:-1])
    # the end of the output: the full blocks of computed tokens, in the plan that drops it
    assert driver.plans[-1].finished_seq_ids == ("a",)
    assert saved(driver.plans[-1]) == [(table[1:3], hashes[1:3], "chat")]
    assert sched.kv_tiers.stats.num_saved_blocks == {"chat": 3}


def test_with_a_plan_in_flight_saves_hold_the_blocks_kv() -> None:
    """Overlap: a stop token arrives while the next plan already computes its KV, so the finish
    saves the block that token ends; a core that lost G1 then loads every saved block, and the
    fake checks their KV. With max_tokens instead, the last token is never computed nor saved."""
    prompt = TEXT[:5]
    out = reference_output(prompt, 20, 64, ignore_eos=True)
    k = next(k for k in range(len(out)) if (len(prompt) + k + 1) % BLOCK_SIZE == 0 and out[k] not in out[:k])
    for stop in ((out[k],), ()):
        params = SamplingParams(temperature=0.0, max_tokens=20 if stop else k + 1, stop_token_ids=stop)
        seq = Sequence("a", "gw", list(prompt), params, EOS)
        driver = Driver(make_scheduler(), max_in_flight=2)
        driver.sched.add(seq)
        driver.run()
        assert seq.output_token_ids == out[: k + 1]
        assert (seq.num_computed_tokens == seq.num_tokens) == bool(stop)
        num_saved = sum(len(split_hashes(s.block_hashes)) for p in driver.plans for s in p.kv_saves)
        assert num_saved == min(seq.num_computed_tokens, seq.num_tokens) // BLOCK_SIZE
        sched = make_scheduler()
        dump_host(driver.worker, sched)
        new = Driver(sched, driver.worker).serve(make_seq("b", [*prompt, *seq.output_token_ids, 1]))
        assert new.num_computed_tokens == num_saved * BLOCK_SIZE
        assert sched.kv_tiers.stats.num_loaded_host_blocks == num_saved


def test_abort_saves_and_an_error_does_not() -> None:
    sched = make_scheduler()
    worker = FakeWorker(BLOCK_SIZE)
    sched.add(make_seq("a", TEXT[:9], max_tokens=20))
    sched.add(make_seq("b", TEXT[:9], max_tokens=20))  # same plan: no G1 hit, its own save
    for _ in range(5):  # 14 tokens each, 13 computed
        sched.postprocess(*worker.execute(sched.schedule()))
    sched.abort("a")
    ids, tokens = worker.execute(sched.schedule())
    sched.postprocess(ids, tokens, failed={"b": "grammar failed"})
    sched.check_integrity()
    worker.execute(sched.schedule())
    assert not sched.has_work()
    # a and b: their 2 prompt blocks; then a's third block on abort, and nothing for b's error
    assert [len(split_hashes(s.block_hashes)) for s in worker.saves] == [2, 2, 1]
    assert sched.kv_tiers.stats.num_saved_blocks == {"": 5}


def test_preemption_saves_nothing_and_no_block_is_saved_twice() -> None:
    driver = Driver(make_scheduler(num_blocks=8), events=False)
    driver.sched.add(make_seq("a", list(range(10, 20)), max_tokens=12))
    victim = make_seq("b", list(range(20, 30)), max_tokens=12)
    victim.priority = 1
    driver.sched.add(victim)
    driver.run()
    assert victim.num_preemptions > 0
    victim_chain = set(chain(victim.prompt_token_ids + victim.output_token_ids))
    saves = [split_hashes(s.block_hashes) for p in driver.plans for s in p.kv_saves]
    victim_saves = [hashes for hashes in saves if set(hashes) <= victim_chain]
    assert [len(hashes) for hashes in victim_saves] == [2, 3]  # its prompt, then at its finish


def test_a_plan_that_only_saves_is_sent() -> None:
    sched = make_scheduler()
    driver = Driver(sched, max_in_flight=2, events=False)
    sched.add(make_seq("a", TEXT[:5], max_tokens=1))
    driver.step()  # plan 1 computes the prompt and samples its one token
    driver.step()  # plan 2, before result 1: nothing to run, but the prompt's block to save
    assert len(driver.plans) == 2
    only_saves = driver.plans[1]
    assert only_saves.num_scheduled_seqs == 0 and only_saves.finished_seq_ids == ()
    assert [len(h) for _, h, _ in saved(only_saves)] == [1]
    driver.run()
    assert not sched.has_work() and sched.kv_tiers.stats.num_saves == 1


def test_saves_skip_blocks_host_memory_holds_and_tiers_can_be_off() -> None:
    sched = make_scheduler()
    sched.note_host_blocks(stored=chain(TEXT[:4]))  # block 0 (and the worker dedups G3 itself)
    driver = Driver(sched, warm_worker([*TEXT[:4], 1]), events=False)
    driver.serve(make_seq("a", TEXT[:9], max_tokens=1))
    (save,) = [s for p in driver.plans for s in p.kv_saves]
    assert split_hashes(save.block_hashes) == chain(TEXT[:8])[1:]
    off = make_scheduler(tiers=False)
    off.note_host_blocks(stored=chain(TEXT[:8]))
    driver = Driver(off)
    new = driver.serve(make_seq("b", TEXT[:9], num_stored_blocks=2))
    assert new.kv_load is None and new.num_computed_tokens == 0
    assert all(p.kv_saves == () for p in driver.plans) and off.kv_tiers.num_host_blocks == 0


def test_host_blocks_follow_events_and_count_for_routing() -> None:
    sched = make_scheduler()
    hashes = chain(TEXT)
    sched.note_host_blocks(stored=hashes[:3])
    assert sched.kv_tiers.num_reusable_blocks(hashes) == 3
    sched.note_host_blocks(removed=[hashes[1]])
    assert sched.kv_tiers.num_reusable_blocks(hashes) == 1
    sched.note_host_blocks(cleared=True)
    assert sched.kv_tiers.num_host_blocks == 0
    sched.note_host_blocks(stored=hashes[1:2], cleared=True)  # a dump replaces the whole set
    assert sched.kv_tiers.num_reusable_blocks(hashes) == 0 and sched.kv_tiers.num_host_blocks == 1
    Driver(sched).serve(make_seq("a", [*TEXT[:4], 1]))  # G1 now holds block 0: 0 and 1 count
    assert sched.kv_tiers.num_reusable_blocks(hashes) == 2
    assert sched.kv_tiers.prompt_chain([*TEXT[:8], 1], "") == hashes[:2]
    assert sched.kv_tiers.prompt_chain(TEXT[:8], "") == hashes[:1]  # never the last token's block
    sched.check_integrity()


def test_routing_prefers_the_cached_prefix_unless_the_worker_is_full() -> None:
    cold = WorkerState("w1", 1, 8, 0, 4)
    warm = WorkerState("w2", 4, 8, 4, 4)  # busier, but holds the whole prompt
    assert pick_worker([cold, warm]) == "w2"
    half = WorkerState("w2", 4, 8, 1, 4)  # 1/4 cached does not pay for 3/8 more load
    assert pick_worker([cold, half]) == "w1"
    full = WorkerState("w2", 8, 8, 4, 4)
    assert pick_worker([cold, full]) == "w1"
    assert pick_worker([full, WorkerState("w3", 9, 8)]) == "w2"  # all full: still the best
    assert pick_worker([WorkerState("b", 1, 8, 2, 4), WorkerState("a", 1, 8, 2, 4)]) == "a"


@pytest.mark.parametrize(
    ("seqs", "verdicts"),
    [
        ([1, 2, 3], ["RESTART", "APPLY", "APPLY"]),
        ([5], ["RESYNC"]),  # joined late: nothing to continue from
        ([1, 3], ["RESTART", "RESYNC"]),  # a gap
        ([1, 2, 2, 1], ["RESTART", "APPLY", "IGNORE", "RESTART"]),  # a duplicate, then a restart
    ],
)
def test_event_cursor(seqs: list[int], verdicts: list[str]) -> None:
    cursor = EventCursor()
    assert [cursor.accept(s).name for s in seqs] == verdicts


def test_event_cursor_continues_after_a_dump() -> None:
    cursor = EventCursor()
    assert cursor.accept(7) is EventVerdict.RESYNC
    cursor.resynced(8)
    assert [cursor.accept(s) for s in (7, 8, 9)] == [EventVerdict.IGNORE] * 2 + [EventVerdict.APPLY]


def test_saves_of_a_finished_sequence_are_dropped_with_the_worker() -> None:
    sched = make_scheduler()
    sched.add(make_seq("a", TEXT[:9]))
    sched.schedule()
    assert sched.kv_tiers.has_pending_saves
    sched.fail_all()
    sched.check_integrity()
    assert not sched.has_work() and sched.schedule().kv_saves == ()


def test_round_robin_takes_the_workers_with_room_in_turn() -> None:
    free = [WorkerState(w, 0, 4) for w in ("w2", "w1", "w3")]
    assert [pick_in_turn(free, turn) for turn in range(4)] == ["w1", "w2", "w3", "w1"]
    full = WorkerState("w1", 4, 4, num_cached_blocks=8, num_prompt_blocks=8)
    assert [pick_in_turn([full, free[0]], turn) for turn in range(2)] == ["w2", "w2"]
    assert pick_in_turn([full], 0) == "w1" and pick_in_turn([], 0) is None
