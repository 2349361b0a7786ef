"""Prefix caching (G1) in the scheduler core, driven by the fake worker: a hit skips exactly the
cached tokens, never the last one; tenants share nothing; eviction, preemption, choices and a
second plan in flight compose with it. The fake worker checks every position a sequence attends
to holds that sequence's own prefix, so a wrong hit fails loudly rather than changing an output.
"""

from __future__ import annotations

from libs.protocol.codec import unpack_tokens
from libs.protocol.messages import NewSequence, SamplingParams
from services.scheduler.sequence import Sequence
from services.scheduler.worker_scheduler import Limits, WorkerScheduler
from tests.unit.scheduler.driver import Driver
from tests.unit.scheduler.fake_worker import EOS, reference_output

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
PREFIX = list(range(10, 18))  # two full blocks


def make_scheduler(num_blocks: int = 64, max_num_seqs: int = 4, enable: bool = True) -> WorkerScheduler:
    limits = Limits(num_blocks, BLOCK_SIZE, max_num_seqs, MAX_MODEL_LEN, 256, 16, 0.0, enable)
    return WorkerScheduler(limits, model_fingerprint="tiny")


def make_seq(seq_id: str, prompt: list[int], max_tokens: int = 3, tenant: str = "", n: int = 1) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)
    return Sequence(seq_id, "gw", list(prompt), params, EOS, tenant=tenant)


def serve(driver: Driver, seq: Sequence) -> NewSequence:
    """Add ``seq``, run until idle; returns its first admission, after checking its output."""
    driver.sched.add(seq)
    outputs = driver.run()
    max_tokens = seq.sampling_params.max_tokens
    want = reference_output(seq.prompt_token_ids, max_tokens, MAX_MODEL_LEN, ignore_eos=True)
    assert outputs[seq.seq_id] == want
    return driver.admissions(seq.seq_id)[0]


def test_a_second_prompt_with_the_same_prefix_computes_only_the_rest() -> None:
    driver = Driver(make_scheduler(), events=False)
    first = serve(driver, make_seq("a", [*PREFIX, 1, 2, 3]))
    assert first.num_computed_tokens == 0 and first.num_scheduled_tokens == 11
    second = make_seq("b", [*PREFIX, 4, 5, 6, 7, 8])
    new = serve(driver, second)
    assert new.num_computed_tokens == 8 and new.num_scheduled_tokens == 5
    assert unpack_tokens(new.block_ids)[:2] == unpack_tokens(first.block_ids)[:2]
    assert second.num_cached_tokens == 8
    stats = driver.sched.prefix_cache_stats
    assert (stats.num_queries, stats.num_query_tokens, stats.num_hit_tokens) == (2, 11 + 13, 8)
    assert driver.sched.block_manager.num_free_blocks == 64


def test_the_last_prompt_token_is_always_computed() -> None:
    driver = Driver(make_scheduler(), events=False)
    serve(driver, make_seq("a", [*PREFIX, 1], max_tokens=4))  # 3 full blocks of KV once done
    exact = serve(driver, make_seq("b", PREFIX))  # the whole prompt is cached: its last block is not
    assert (exact.num_computed_tokens, exact.num_scheduled_tokens) == (4, 4)
    one_more = serve(driver, make_seq("c", [*PREFIX, 1]))  # all but the last token are cached
    assert (one_more.num_computed_tokens, one_more.num_scheduled_tokens) == (8, 1)
    output_too = serve(driver, make_seq("d", [*PREFIX, 1, *reference_output([*PREFIX, 1], 4, 64)[:3]]))
    assert (output_too.num_computed_tokens, output_too.num_scheduled_tokens) == (8, 4)


def test_tenants_share_nothing() -> None:
    driver = Driver(make_scheduler(), events=False)
    serve(driver, make_seq("a", [*PREFIX, 1], tenant="acme"))
    assert serve(driver, make_seq("b", [*PREFIX, 2], tenant="globex")).num_computed_tokens == 0
    assert serve(driver, make_seq("c", [*PREFIX, 3])).num_computed_tokens == 0  # no tenant is a tenant too
    assert serve(driver, make_seq("d", [*PREFIX, 4], tenant="acme")).num_computed_tokens == 8


def test_disabled_prefix_caching_computes_every_prompt() -> None:
    driver = Driver(make_scheduler(enable=False), events=False)
    serve(driver, make_seq("a", [*PREFIX, 1]))
    assert serve(driver, make_seq("b", [*PREFIX, 1])).num_computed_tokens == 0
    assert driver.sched.prefix_cache_stats.num_queries == 0
    assert driver.sched.block_manager.prefix_cache.num_cached_blocks == 0


def test_pressure_evicts_least_recently_used_blocks_first() -> None:
    driver = Driver(make_scheduler(num_blocks=8), events=False)
    serve(driver, make_seq("old", [*PREFIX, 1], max_tokens=1))  # 2 cached blocks
    serve(driver, make_seq("new", [*range(30, 38), 1], max_tokens=1))  # 2 more, used later
    assert driver.sched.block_manager.prefix_cache.num_evictable_blocks == 4
    serve(driver, make_seq("big", list(range(40, 53)), max_tokens=3))  # 4 blocks: 4 free, 0 evicted
    assert driver.sched.prefix_cache_stats.num_evicted_blocks == 0
    serve(driver, make_seq("bigger", list(range(60, 81)), max_tokens=3))  # 6 blocks: evicts 4
    assert driver.sched.prefix_cache_stats.num_evicted_blocks > 0
    assert serve(driver, make_seq("old2", [*PREFIX, 2])).num_computed_tokens == 0  # evicted first
    assert driver.sched.block_manager.num_free_blocks == 8


def test_a_preempted_sequence_finds_its_own_blocks_when_readmitted() -> None:
    # 8 blocks of 4: two sequences of 10 prompt tokens outgrow them after a few decodes; the
    # victim's blocks park in the cache, tail first, and its head survives until it resumes.
    driver = Driver(make_scheduler(num_blocks=8), events=False)
    prompt = list(range(10, 20))
    driver.sched.add(make_seq("a", prompt, max_tokens=12))
    victim = make_seq("b", list(range(20, 30)), max_tokens=12)
    victim.priority = 1
    driver.sched.add(victim)
    outputs = driver.run()
    assert victim.num_preemptions > 0
    first, resumed = driver.admissions("b")
    assert first.num_computed_tokens == 0 and resumed.num_computed_tokens == 8
    assert victim.num_cached_tokens == 0  # usage reports the first admission only
    for seq_id, p in (("a", prompt), ("b", list(range(20, 30)))):
        assert outputs[seq_id] == reference_output(p, 12, MAX_MODEL_LEN, ignore_eos=True)


def test_choices_hit_the_cache_then_share_choice_zeros_blocks() -> None:
    driver = Driver(make_scheduler(), events=False)
    serve(driver, make_seq("a", [*PREFIX, 1, 2, 3, 4, 5]))
    choices = driver.sched.add(make_seq("r", [*PREFIX, 1, 2, 3, 9, 6], n=3))
    driver.run()
    parent = driver.admissions("r")[0]
    assert (parent.num_computed_tokens, parent.num_scheduled_tokens) == (8, 5)
    for child_id in ("r#1", "r#2"):
        child = driver.admissions(child_id)[0]
        assert child.num_computed_tokens == 12  # shared from choice 0, past the cached prefix
        assert unpack_tokens(child.block_ids)[:3] == unpack_tokens(parent.block_ids)[:3]
    want = reference_output([*PREFIX, 1, 2, 3, 9, 6], 3, MAX_MODEL_LEN, ignore_eos=True)
    assert all(driver.outputs[c.seq_id] == want for c in choices)
    assert [c.num_cached_tokens for c in choices] == [8, 0, 0]


def test_with_a_plan_in_flight_hits_come_only_from_earlier_plans() -> None:
    """Overlap: plan 2 is made before result 1 arrives. A prompt admitted in the same plan as its
    twin finds nothing; one admitted in the next plan reads the blocks plan 1 is still writing."""
    sched = make_scheduler()
    driver = Driver(sched, max_in_flight=2)
    sched.add(make_seq("a", [*PREFIX, 1]))
    sched.add(make_seq("b", [*PREFIX, 2]))  # same plan as a: no hit
    driver.step()
    sched.add(make_seq("c", [*PREFIX, 3]))  # next plan, made with plan 1 in flight
    driver.step()
    # plan 2 decodes a and b on tokens only the worker knows yet: result 1 was not in
    assert len(driver.plans) == 2 and driver.plans[1].seq_ids == ("a", "b")
    outputs = driver.run()
    computed = {new.seq_id: new.num_computed_tokens for plan in driver.plans for new in plan.new_seqs}
    assert computed == {"a": 0, "b": 0, "c": 8}
    for seq_id, last in (("a", 1), ("b", 2), ("c", 3)):
        assert outputs[seq_id] == reference_output([*PREFIX, last], 3, MAX_MODEL_LEN, ignore_eos=True)


def test_a_prefix_is_found_while_its_prompt_is_still_in_chunked_prefill() -> None:
    limits = Limits(64, BLOCK_SIZE, 4, MAX_MODEL_LEN, 10, 16, 0.0)  # 10 tokens per step
    sched = WorkerScheduler(limits)
    driver = Driver(sched, events=False)
    long_prompt = list(range(10, 35))
    sched.add(make_seq("long", long_prompt))
    driver.step()  # tokens 0..9
    driver.step()  # tokens 10..19
    twin_prompt = [*long_prompt[:22], 99]
    sched.add(make_seq("twin", twin_prompt))
    driver.step()  # long's last chunk, 20..24, then twin in the budget left
    (twin,) = driver.plans[-1].new_seqs
    # Blocks 0..4 (tokens 0..19) come from plans 1 and 2; block 5 is being written by this plan.
    assert (twin.num_computed_tokens, twin.num_scheduled_tokens) == (20, 3)
    outputs = driver.run()
    assert outputs["twin"] == reference_output(twin_prompt, 3, MAX_MODEL_LEN, ignore_eos=True)
