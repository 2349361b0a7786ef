"""Pause and resume in the scheduler core, driven by the fake worker (integrity checked after every
plan and result): a paused request leaves the worker and its running slot at once, is in no plan
until resumed, and resumes over a prefix hit covering its prompt and the outputs it had, going on
exactly as if it had never stopped. A cancel of a paused request frees everything; so does its
deadline passing."""

from __future__ import annotations

import pytest

from libs.protocol.codec import unpack_tokens
from libs.protocol.messages import FinishReason, SamplingParams, SchedulerOutput
from services.scheduler.pausing import ResumedBy
from services.scheduler.sequence import Sequence, SequenceStatus
from services.scheduler.worker_scheduler import Limits, WorkerScheduler
from tests.unit.scheduler.driver import Driver
from tests.unit.scheduler.fake_worker import EOS, reference_output

BLOCK_SIZE = 4
NUM_BLOCKS = 64
MAX_MODEL_LEN = 64
PROMPT = list(range(10, 20))  # two full blocks and a half


def make_scheduler(max_num_seqs: int = 1) -> WorkerScheduler:
    limits = Limits(NUM_BLOCKS, BLOCK_SIZE, max_num_seqs, MAX_MODEL_LEN, 256, 16, 0.0)
    return WorkerScheduler(limits, model_fingerprint="tiny")


def make_seq(seq_id: str, prompt: list[int], max_tokens: int = 12, n: int = 1) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)
    return Sequence(seq_id, "gw", list(prompt), params, EOS)


def want(prompt: list[int], max_tokens: int = 12) -> list[int]:
    return reference_output(prompt, max_tokens, MAX_MODEL_LEN, ignore_eos=True)


def in_plan(plan: SchedulerOutput) -> set[str]:
    return {new.seq_id for new in plan.new_seqs} | set(plan.seq_ids)


def run_until_outputs(driver: Driver, seq: Sequence, num_outputs: int) -> None:
    while seq.num_output_tokens < num_outputs:
        driver.step()


def assert_nothing_held(sched: WorkerScheduler) -> None:
    assert sched.num_running == 0 and not sched.block_manager.block_tables
    assert sched.block_manager.num_free_blocks == NUM_BLOCKS  # free, or cached and evictable


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_a_paused_request_leaves_the_worker_and_resumes_over_a_hit_exactly(max_in_flight: int) -> None:
    sched = make_scheduler(max_num_seqs=1)
    driver = Driver(sched, max_in_flight=max_in_flight)
    a = sched.add(make_seq("a", PROMPT))[0]
    run_until_outputs(driver, a, 5)
    assert sched.pause("a", deadline=100.0) == [a]
    sched.check_integrity()
    assert a.status is SequenceStatus.PAUSED and sched.num_paused == 1
    assert_nothing_held(sched)  # the slot and the KV are free at once
    num_plans = len(driver.plans)

    b = sched.add(make_seq("b", [3, 4, 5], max_tokens=4))[0]  # takes the only running slot
    assert driver.run() == {"b": want([3, 4, 5], 4)}
    assert "a" in driver.plans[num_plans].finished_seq_ids  # the worker dropped it with the next plan
    assert all("a" not in in_plan(plan) for plan in driver.plans[num_plans:])  # and never ran it since
    assert "a" not in driver.worker.seqs and b.is_finished
    num_outputs = a.num_output_tokens  # with a second plan in flight, its token was kept

    assert sched.resume("a") == [a]
    assert sched.resume("a") == []  # resumed once
    assert driver.run()["a"] == want(PROMPT)  # exactly the rest
    first, again = driver.admissions("a")
    assert unpack_tokens(again.output_token_ids) == want(PROMPT)[:num_outputs]
    # The hit covers the prompt and the outputs: all full blocks but the one with the last token.
    assert again.num_computed_tokens == (len(PROMPT) + num_outputs - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert again.num_computed_tokens > len(PROMPT)
    assert a.num_cached_tokens == first.num_computed_tokens == 0  # usage: the first admission's hit
    assert_nothing_held(sched)


def test_a_waiting_request_paused_stays_out_of_the_queue_until_resumed() -> None:
    sched = make_scheduler(max_num_seqs=1)
    driver = Driver(sched)
    sched.add(make_seq("a", PROMPT, max_tokens=3))
    b = sched.add(make_seq("b", [3, 4, 5], max_tokens=3))[0]
    driver.step()  # a runs, b waits for the slot
    assert sched.pause("b", deadline=100.0) == [b] and sched.num_waiting == 0
    sched.check_integrity()
    assert driver.run() == {"a": want(PROMPT, 3)}
    assert not driver.admissions("b") and not sched.has_work()
    sched.resume("b")
    assert driver.run()["b"] == want([3, 4, 5], 3)
    assert b.num_pauses == 0  # it never left the worker: usage counts its one admission's hit


def test_every_choice_pauses_and_resumes() -> None:
    sched = make_scheduler(max_num_seqs=4)
    driver = Driver(sched, max_in_flight=2)
    choices = sched.add(make_seq("r", PROMPT, n=3))
    run_until_outputs(driver, choices[2], 4)
    assert sched.pause("r", deadline=100.0) == choices
    sched.check_integrity()
    assert_nothing_held(sched)
    driver.run()
    assert all(not c.is_finished for c in choices)
    assert sched.resume("r") == choices
    outputs = driver.run()
    assert [outputs[c.seq_id] for c in choices] == [want(PROMPT)] * 3
    assert all(len(driver.admissions(c.seq_id)) == 2 for c in choices)


def test_a_cancel_of_a_paused_request_frees_everything() -> None:
    sched = make_scheduler()
    driver = Driver(sched, max_in_flight=2)
    a = sched.add(make_seq("a", PROMPT))[0]
    run_until_outputs(driver, a, 3)
    sched.pause("a", deadline=100.0)
    assert sched.abort("a") == [a]
    sched.check_integrity()
    assert a.finish_reason is FinishReason.ABORT and not sched.seqs and sched.num_paused == 0
    driver.run()  # the drop reaches the worker; a result in flight is dropped
    assert "a" not in driver.worker.seqs and not sched.has_work()
    assert_nothing_held(sched)
    assert sched.resume("a") == [] and sched.pause("a", 1.0) == []


def test_a_paused_request_expires_at_its_deadline() -> None:
    sched = make_scheduler()
    driver = Driver(sched)
    a = sched.add(make_seq("a", PROMPT))[0]
    run_until_outputs(driver, a, 2)
    sched.pause("a", deadline=10.0)
    sched.pause("a", deadline=20.0)  # paused again: the later deadline holds
    assert sched.expire_paused(19.9) == []
    assert sched.expire_paused(20.0) == [a]
    sched.check_integrity()
    assert a.finish_reason is FinishReason.ABORT and not sched.seqs
    driver.run()
    assert_nothing_held(sched)
    resumed = sched.add(make_seq("b", PROMPT))[0]  # a later request still reuses its blocks
    driver.run()
    assert driver.outputs["b"] == want(PROMPT) and resumed.num_cached_tokens == 8


def test_a_resumed_request_does_not_overtake_the_queue_order() -> None:
    """Resumed, it takes its old place (by arrival), ahead of requests that came after it."""
    sched = make_scheduler(max_num_seqs=1)
    driver = Driver(sched)
    a = sched.add(make_seq("a", PROMPT, max_tokens=3))[0]
    driver.step()
    sched.pause("a", deadline=100.0)
    sched.add(make_seq("b", [3, 4, 5], max_tokens=3))
    sched.resume("a")
    driver.step()
    assert in_plan(driver.plans[-1]) == {"a"}
    assert driver.run() == {"a": want(PROMPT, 3), "b": want([3, 4, 5], 3)}
    assert a.num_pauses == 1


def test_a_pause_from_the_gateway_a_reader_left_is_stale_once_another_resumed() -> None:
    """g1's reader left (its pause is delayed), the client resumed at g2: g1's pause arriving
    after g2's resume is ignored; g2's own pause, and any pause once the window is over, count."""
    readers = ResumedBy(window_s=20.0)
    assert readers.admit("r", "g1", resume=False, now=0.0)  # nothing resumed yet
    assert readers.admit("r", "g2", resume=True, now=1.0)
    assert not readers.admit("r", "g1", resume=False, now=1.5)
    assert readers.admit("r", "g2", resume=False, now=2.0)  # its new reader left in turn
    assert readers.admit("other", "g1", resume=False, now=2.0)
    assert readers.admit("r", "g1", resume=False, now=30.0)
