"""A sequence the worker failed finishes alone with ERROR, whether or not it sampled, and none of
its blocks not yet cached enters the prefix cache (the worker may never have written them)."""

from __future__ import annotations

from libs.protocol.messages import FinishReason, SamplingParams
from services.scheduler.sequence import Sequence
from services.scheduler.worker_scheduler import Limits, WorkerScheduler
from tests.unit.scheduler.fake_worker import EOS

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def make_scheduler(max_num_batched_tokens: int) -> WorkerScheduler:
    return WorkerScheduler(Limits(64, 4, 4, 64, max_num_batched_tokens, 8, 0.0))


def test_a_failed_prefill_chunk_finishes_alone_and_caches_nothing() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add(Sequence("ok", "gw", [30, 31, 32], GREEDY, EOS))
    sched.add(Sequence("bad", "gw", list(range(10, 22)), GREEDY, EOS))
    plan = sched.schedule()
    assert [(s.seq_id, s.num_scheduled_tokens) for s in plan.new_seqs] == [("ok", 3), ("bad", 5)]
    # "bad" computed a first chunk (one full block), sampled nothing, and failed
    changed = sched.postprocess(("ok",), [7], failed={"bad": "token id 99 is outside"})
    assert {s.seq_id: s.finish_reason for s in changed} == {"bad": FinishReason.ERROR, "ok": None}
    assert changed[0].error == "token id 99 is outside"
    assert set(sched.seqs) == {"ok"}
    plan = sched.schedule()
    sched.check_integrity()
    assert plan.finished_seq_ids == ("bad",) and plan.seq_ids == ("ok",)
    sched.add(Sequence("again", "gw", list(range(10, 22)), GREEDY, EOS))
    plan = sched.schedule()
    (again,) = plan.new_seqs
    assert again.num_computed_tokens == 0  # no hit on the failed sequence's first block


def test_a_failed_sequence_that_sampled_drops_its_token() -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add(Sequence("a", "gw", [10, 11, 12], GREEDY, EOS))
    sched.add(Sequence("b", "gw", [20, 21], GREEDY, EOS))
    sched.schedule()
    changed = sched.postprocess(("a", "b"), [7, 8], failed={"a": "logits are not finite"})
    assert [(s.seq_id, s.finish_reason, s.output_token_ids) for s in changed] == [
        ("a", FinishReason.ERROR, []),
        ("b", None, [8]),
    ]
    sched.check_integrity()


def test_blocks_a_plan_in_flight_cached_leave_the_cache_when_their_sequence_fails() -> None:
    """Overlap: the second plan is made before the first one's result, and caches the block the
    first plan's chunk computed. That chunk failed on the worker, so the block must not be hit."""
    sched = make_scheduler(max_num_batched_tokens=4)
    prompt = list(range(10, 22))
    sched.add(Sequence("bad", "gw", prompt, GREEDY, EOS))
    first = sched.next_plan(0, 2)
    second = sched.next_plan(1, 2)
    assert first is not None and second is not None
    assert sched.block_manager.prefix_cache.num_cached_blocks == 1  # cached by the second plan
    sched.postprocess((), [], failed={"bad": "logits are not finite"})
    sched.check_integrity()
    assert sched.block_manager.prefix_cache.num_cached_blocks == 0
    sched.postprocess((), [])  # the second plan's result: nothing for a finished sequence
    sched.add(Sequence("again", "gw", prompt, GREEDY, EOS))
    plan = sched.schedule()
    sched.check_integrity()
    (again,) = plan.new_seqs
    assert again.num_computed_tokens == 0


def test_a_failed_sequences_queued_saves_do_not_ride_in_the_next_plan() -> None:
    """The prompt's save is queued with the chunk that ends it; that chunk failed on the worker,
    so the next plan must not ask the worker to keep blocks whose KV it never wrote."""
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add(Sequence("bad", "gw", list(range(10, 22)), GREEDY, EOS))
    sched.schedule()
    assert sched.kv_tiers.has_pending_saves  # the store point: the end of the user input
    sched.postprocess((), [], failed={"bad": "logits are not finite"})
    sched.check_integrity()
    plan = sched.schedule()
    assert plan.finished_seq_ids == ("bad",) and plan.kv_saves == ()
    assert sched.kv_tiers.stats.num_saves == 0


def test_a_failed_sequence_takes_its_blocks_out_of_the_cache_even_when_another_holds_them() -> None:
    """Overlap: a plan made before the failure was known let "hit" reuse a block of "bad"; the
    block leaves the cache (the worker recomputes it for "hit"), so no later request finds it."""
    sched = make_scheduler(max_num_batched_tokens=8)
    prompt = list(range(10, 22))
    sched.add(Sequence("bad", "gw", prompt, GREEDY, EOS))
    assert sched.next_plan(0, 2) is not None
    sched.add(Sequence("hit", "gw", prompt[:9], GREEDY, EOS))
    second = sched.next_plan(1, 2)
    assert second is not None and [s.seq_id for s in second.new_seqs] == ["hit"]
    assert second.new_seqs[0].num_computed_tokens == 8  # the blocks the first plan computed
    sched.postprocess((), [], failed={"bad": "logits are not finite"})
    sched.check_integrity()
    assert sched.block_manager.prefix_cache.num_cached_blocks == 0
