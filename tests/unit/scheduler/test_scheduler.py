from __future__ import annotations

import pytest

from libs.protocol.codec import unpack_tokens
from libs.protocol.errors import QueueFull
from libs.protocol.messages import FinishReason, SamplingParams
from services.scheduler.router import WorkerState, pick_worker
from services.scheduler.scheduler import Scheduler
from services.scheduler.sequence import Sequence, SequenceStatus

EOS = 2


def make_seq(
    seq_id: str, prompt_len: int = 3, max_tokens: int = 4, priority: int = 0, **kw: object
) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    return Sequence(seq_id, "gw", list(range(10, 10 + prompt_len)), params, EOS, priority=priority)


def make_scheduler(max_num_seqs: int = 2, max_model_len: int = 64, max_num_waiting: int = 8) -> Scheduler:
    return Scheduler(max_num_seqs, max_model_len, max_num_waiting)


def test_new_sequences_are_sent_once_then_decoded_by_id() -> None:
    sched = make_scheduler()
    sched.add(make_seq("a"))
    plan = sched.schedule()
    sched.check_integrity()
    assert [s.seq_id for s in plan.new_seqs] == ["a"]
    assert unpack_tokens(plan.new_seqs[0].prompt_token_ids) == [10, 11, 12]
    assert plan.decode_seq_ids == ()
    sched.postprocess(("a",), [7])
    plan = sched.schedule()
    sched.check_integrity()
    assert plan.new_seqs == () and plan.decode_seq_ids == ("a",)


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
    assert plan.decode_seq_ids == ("second",)
    assert plan.finished_seq_ids == ("first",)


def test_finish_reasons() -> None:
    sched = make_scheduler(max_num_seqs=4, max_model_len=5)
    for seq in (
        make_seq("eos"),
        make_seq("stop_id", stop_token_ids=(99,)),
        make_seq("len", max_tokens=1),
        make_seq("ctx", max_tokens=100),
        make_seq("ign", ignore_eos=True),
    ):
        sched.add(seq)
    plan = sched.schedule()
    ids = tuple(s.seq_id for s in plan.new_seqs)
    changed = {s.seq_id: s for s in sched.postprocess(ids, [EOS, 99, 5, 5])}
    sched.check_integrity()
    assert changed["eos"].finish_reason is FinishReason.STOP
    assert changed["stop_id"].finish_reason is FinishReason.STOP
    assert changed["len"].finish_reason is FinishReason.LENGTH
    assert not changed["ctx"].is_finished
    plan = sched.schedule()
    assert [s.seq_id for s in plan.new_seqs] == ["ign"] and plan.decode_seq_ids == ("ctx",)
    changed = {s.seq_id: s for s in sched.postprocess(("ign", "ctx"), [EOS, 5])}
    assert changed["ctx"].finish_reason is FinishReason.LENGTH  # 3 prompt + 2 out = the context of 5
    assert not changed["ign"].is_finished  # ignore_eos
    sched.check_integrity()


def test_abort_waiting_and_running() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add(make_seq("run"))
    sched.add(make_seq("wait"))
    sched.schedule()
    assert sched.abort("wait") is not None
    sched.check_integrity()
    assert sched.num_waiting == 0
    assert sched.abort("run") is not None
    sched.check_integrity()
    assert sched.has_work()  # the worker must still be told
    plan = sched.schedule()
    assert plan.finished_seq_ids == ("run",) and plan.num_scheduled_seqs == 0
    assert not sched.has_work()
    assert sched.abort("run") is None
    assert sched.postprocess(("run",), [5]) == []  # a token for an aborted sequence is dropped


def test_queue_full() -> None:
    sched = make_scheduler(max_num_waiting=1)
    sched.add(make_seq("a"))
    with pytest.raises(QueueFull):
        sched.add(make_seq("b"))
    sched.check_integrity()


def test_fail_all_and_fail() -> None:
    sched = make_scheduler()
    sched.add(make_seq("a"))
    sched.add(make_seq("b"))
    sched.schedule()
    failed = sched.fail(("a",))
    assert [s.seq_id for s in failed] == ["a"]
    assert failed[0].status is SequenceStatus.FINISHED and failed[0].finish_reason is FinishReason.ERROR
    sched.check_integrity()
    assert [s.seq_id for s in sched.fail_all()] == ["b"]
    sched.check_integrity()
    assert not sched.has_work()


def test_pick_worker_least_loaded() -> None:
    assert pick_worker([]) is None
    workers = [WorkerState("w2", 3, 4), WorkerState("w1", 3, 4), WorkerState("w3", 4, 16)]
    assert pick_worker(workers) == "w3"
    assert pick_worker(workers[:2]) == "w1"
