from __future__ import annotations

import pytest

from libs.protocol.codec import unpack_tokens
from libs.protocol.errors import QueueFull
from libs.protocol.messages import FinishReason, SamplingParams, SchedulerOutput
from services.scheduler.router import WorkerState, pick_worker
from services.scheduler.sequence import Sequence, SequenceStatus
from services.scheduler.worker_scheduler import Limits, WorkerScheduler
from tests.unit.scheduler.fake_worker import EOS, FakeWorker, reference_output


def make_seq(
    seq_id: str, prompt_len: int = 3, max_tokens: int = 4, priority: int = 0, **kw: object
) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    return Sequence(seq_id, "gw", list(range(10, 10 + prompt_len)), params, EOS, priority=priority)


def make_scheduler(
    max_num_seqs: int = 2,
    max_model_len: int = 64,
    max_num_waiting: int = 8,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 256,
) -> WorkerScheduler:
    limits = Limits(
        num_blocks, block_size, max_num_seqs, max_model_len, max_num_batched_tokens, max_num_waiting, 0.0
    )
    return WorkerScheduler(limits)


def scheduled(plan: SchedulerOutput) -> dict[str, int]:
    counts = {s.seq_id: s.num_scheduled_tokens for s in plan.new_seqs}
    counts.update(zip(plan.seq_ids, unpack_tokens(plan.num_scheduled_tokens), strict=True))
    return counts


def test_new_sequences_are_sent_once_then_decoded_by_id() -> None:
    sched = make_scheduler()
    sched.add(make_seq("a", prompt_len=5, max_tokens=10))
    plan = sched.schedule()
    sched.check_integrity()
    (new,) = plan.new_seqs
    assert new.seq_id == "a" and unpack_tokens(new.prompt_token_ids) == [10, 11, 12, 13, 14]
    assert new.num_scheduled_tokens == 5 and new.num_computed_tokens == 0
    assert len(unpack_tokens(new.block_ids)) == 2  # 5 tokens in blocks of 4
    sched.postprocess(("a",), [7])
    plan = sched.schedule()
    sched.check_integrity()
    assert plan.new_seqs == () and scheduled(plan) == {"a": 1}
    assert plan.new_block_ids == (b"",)  # position 5 still fits in the second block
    for token in (8, 9):  # positions 6 and 7
        sched.postprocess(("a",), [token])
        plan = sched.schedule()
        assert plan.new_block_ids == (b"",)
    sched.postprocess(("a",), [10])
    plan = sched.schedule()  # position 8 opens a third block
    sched.check_integrity()
    assert len(unpack_tokens(plan.new_block_ids[0])) == 1
    assert len(sched.block_manager.block_tables["a"]) == 3


def test_chunked_prefill_respects_the_token_budget_and_decodes_go_first() -> None:
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=8)
    sched.add(make_seq("short", prompt_len=3))
    plan = sched.schedule()
    sched.postprocess(("short",), [7])
    sched.add(make_seq("long", prompt_len=20))
    counts = []
    for _ in range(3):
        plan = sched.schedule()
        sched.check_integrity()
        counts.append(scheduled(plan))
        sampled = [7] * len(plan.new_seqs + plan.seq_ids)
        ids = tuple(s.seq_id for s in plan.new_seqs) + plan.seq_ids
        # only sequences whose chunk reached the end sample; the long prompt samples on its last chunk
        sampling = tuple(i for i in ids if i == "short" or sched.seqs["long"].num_computed_tokens == 20)
        sched.postprocess(sampling, sampled[: len(sampling)])
    assert counts == [{"short": 1, "long": 7}, {"short": 1, "long": 7}, {"short": 1, "long": 6}]


def test_max_num_seqs_caps_running_and_priority_orders_waiting() -> None:
    sched = make_scheduler(max_num_seqs=2)
    sched.add(make_seq("low", priority=5))
    sched.add(make_seq("first", priority=0))
    sched.add(make_seq("second", priority=0))
    plan = sched.schedule()
    sched.check_integrity()
    assert [s.seq_id for s in plan.new_seqs] == ["first", "second"]
    assert sched.num_waiting == 1
    sched.postprocess(("first", "second"), [EOS, 5])  # "first" stops on EOS
    plan = sched.schedule()
    sched.check_integrity()
    assert [s.seq_id for s in plan.new_seqs] == ["low"]
    assert plan.seq_ids == ("second",)
    assert plan.finished_seq_ids == ("first",)


def test_finish_reasons_and_min_tokens() -> None:
    sched = make_scheduler(max_num_seqs=8, max_model_len=5)
    for seq in (
        make_seq("eos"),
        make_seq("stop_id", stop_token_ids=(99,)),
        make_seq("len", max_tokens=1),
        make_seq("ctx", max_tokens=100),
        make_seq("ign", ignore_eos=True),
        make_seq("min", min_tokens=1),
    ):
        sched.add(seq)
    plan = sched.schedule()
    ids = tuple(s.seq_id for s in plan.new_seqs)
    changed = {s.seq_id: s for s in sched.postprocess(ids, [EOS, 99, 5, 5, EOS, EOS])}
    sched.check_integrity()
    assert changed["eos"].finish_reason is FinishReason.STOP
    assert changed["stop_id"].finish_reason is FinishReason.STOP
    assert changed["len"].finish_reason is FinishReason.LENGTH
    assert not changed["ctx"].is_finished
    assert not changed["ign"].is_finished  # ignore_eos
    assert not changed["min"].is_finished  # EOS before min_tokens does not stop
    plan = sched.schedule()
    assert set(scheduled(plan)) == {"ctx", "ign", "min"}
    changed = {s.seq_id: s for s in sched.postprocess(("ctx", "ign", "min"), [5, 5, EOS])}
    assert changed["ctx"].finish_reason is FinishReason.LENGTH  # 3 prompt + 2 out = the context of 5
    assert changed["min"].finish_reason is FinishReason.STOP
    sched.check_integrity()


def test_abort_waiting_and_running() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add(make_seq("run"))
    sched.add(make_seq("wait"))
    sched.schedule()
    assert [s.seq_id for s in sched.abort("wait")] == ["wait"]
    sched.check_integrity()
    assert sched.num_waiting == 0
    assert sched.abort("run")
    sched.check_integrity()
    assert sched.has_work()  # the worker must still be told
    plan = sched.schedule()
    assert plan.finished_seq_ids == ("run",) and plan.num_scheduled_seqs == 0
    assert not sched.has_work()
    assert sched.abort("run") == []
    assert sched.postprocess(("run",), [5]) == []  # a token for an aborted sequence is dropped
    assert sched.block_manager.num_free_blocks == 64


def test_queue_full_counts_choices() -> None:
    sched = make_scheduler(max_num_waiting=3)
    sched.add(make_seq("a"))
    with pytest.raises(QueueFull):
        sched.add(make_seq("b", n=3))
    sched.add(make_seq("c", n=2))
    sched.check_integrity()


def test_choices_share_the_prompt_blocks_and_abort_one_or_all() -> None:
    sched = make_scheduler(max_num_seqs=4, block_size=4)
    sched.add(make_seq("r", prompt_len=10, n=3, seed=7))
    worker = FakeWorker(4)
    plan = sched.schedule()
    assert [s.seq_id for s in plan.new_seqs] == ["r"]  # choices wait for the prompt
    sched.postprocess(*worker.execute(plan))
    plan = sched.schedule()
    sched.check_integrity()
    children = {s.seq_id: s for s in plan.new_seqs}
    assert set(children) == {"r#1", "r#2"}
    assert children["r#1"].sampling_params.seed == 8 and children["r#2"].sampling_params.seed == 9
    parent_table = sched.block_manager.block_tables["r"]
    for child in children.values():
        assert child.num_computed_tokens == 8 and child.num_scheduled_tokens == 2
        assert unpack_tokens(child.block_ids)[:2] == parent_table[:2]
    sched.postprocess(*worker.execute(plan))
    sched.check_integrity()
    assert [s.seq_id for s in sched.abort("r#1")] == ["r#1"]
    assert {s.seq_id for s in sched.abort("r")} == {"r", "r#2"}
    sched.check_integrity()
    assert sched.block_manager.num_free_blocks == 64


def test_preemption_frees_the_lowest_priority_and_resumes_it_identically() -> None:
    # 6 blocks of 4 tokens: two sequences of 10 prompt tokens fill 6 blocks after a few decodes.
    sched = make_scheduler(max_num_seqs=4, num_blocks=6, block_size=4, max_model_len=64)
    worker = FakeWorker(4)
    sched.add(make_seq("a", prompt_len=10, max_tokens=12))
    sched.add(make_seq("b", prompt_len=10, max_tokens=12, priority=1))
    outputs: dict[str, list[int]] = {}
    preempted = False
    for _ in range(100):
        if not sched.has_work():
            break
        plan = sched.schedule()
        sched.check_integrity()
        preempted |= "b" in plan.finished_seq_ids and "b" in sched.seqs
        for seq in sched.postprocess(*worker.execute(plan)):
            if seq.is_finished:
                outputs[seq.seq_id] = seq.output_token_ids
        sched.check_integrity()
    assert preempted
    for seq_id in ("a", "b"):
        assert outputs[seq_id] == reference_output(list(range(10, 20)), 12, 64)


def test_fail_all() -> None:
    sched = make_scheduler()
    sched.add(make_seq("a"))
    sched.add(make_seq("b"))
    sched.schedule()
    failed = sched.fail_all()
    assert {s.seq_id for s in failed} == {"a", "b"}
    assert all(s.status is SequenceStatus.FINISHED and s.finish_reason is FinishReason.ERROR for s in failed)
    sched.check_integrity()
    assert not sched.has_work()
    assert sched.block_manager.num_free_blocks == 64


def test_pick_worker_least_loaded() -> None:
    assert pick_worker([]) is None
    workers = [WorkerState("w2", 3, 4), WorkerState("w1", 3, 4), WorkerState("w3", 4, 16)]
    assert pick_worker(workers) == "w3"
    assert pick_worker(workers[:2]) == "w1"
