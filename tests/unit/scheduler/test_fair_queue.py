"""The waiting queue's order: priority, moved sequences, fairness between tenants by admitted cost
per weight (start-time fair queuing), then arrival; and a flooding tenant through the real core."""

from __future__ import annotations

from collections import Counter

from services.scheduler.fair_queue import FairQueue
from services.scheduler.sequence import Sequence
from services.scheduler.worker_scheduler import WorkerScheduler
from tests.unit.scheduler.fake_worker import EOS
from tests.unit.scheduler.test_scheduler import make_scheduler, make_seq


def admit(
    queue: FairQueue, num: int, cost: float = 10.0, weights: dict[str, float] | None = None
) -> list[str]:
    """Pop ``num`` sequences, charging each its tenant, as admission does; checks after each."""
    out = []
    for _ in range(num):
        entry = queue.pop()
        queue.charge(entry.tenant, cost, (weights or {}).get(entry.tenant, 1.0))
        queue.check_integrity()
        out.append(entry.seq_id)
    return out


def test_one_tenant_is_first_come_first_served_within_priority() -> None:
    queue = FairQueue()
    entries = [("late", (0, 5, 0)), ("urgent", (-1, 9, 0)), ("early", (0, 1, 0)), ("c1", (0, 1, 1))]
    for seq_id, order in entries:
        queue.push(seq_id, order, "t")
        queue.check_integrity()
    assert queue.peek(4) == ["urgent", "early", "c1", "late"]
    assert admit(queue, 4) == ["urgent", "early", "c1", "late"]
    assert not queue


def test_a_flooding_tenant_does_not_starve_another() -> None:
    queue = FairQueue()
    for i in range(10):
        queue.push(f"flood{i}", (0, i, 0), "flood")
    queue.push("small0", (0, 10, 0), "small")
    queue.push("small1", (0, 11, 0), "small")
    order = admit(queue, 12)
    # arrival order would serve all ten floods first; here the small tenant's two come within four
    assert order.index("small0") <= 2 and order.index("small1") <= 4, order
    assert [s for s in order if s.startswith("flood")] == [f"flood{i}" for i in range(10)]  # FCFS within


def test_weights_give_shares() -> None:
    queue = FairQueue()
    for i in range(40):
        queue.push(f"a{i}", (0, 2 * i, 0), "a")
        queue.push(f"b{i}", (0, 2 * i + 1, 0), "b")
    served = Counter(s[0] for s in admit(queue, 40, weights={"a": 3.0, "b": 1.0}))
    assert served == {"a": 30, "b": 10}


def test_an_idle_tenant_banks_no_credit() -> None:
    queue = FairQueue()
    for i in range(5):
        queue.push(f"a{i}", (0, i, 0), "a")
    admit(queue, 5)  # a alone: its virtual time runs ahead
    for i in range(4):
        queue.push(f"a{i + 5}", (0, 10 + i, 0), "a")
        queue.push(f"b{i}", (0, 20 + i, 0), "b")  # b arrives later and starts at the clock
    order = admit(queue, 8)
    # b does not get a run of four for the time it was away: the two alternate
    assert all(order[i][0] != order[i + 1][0] for i in range(6)), order


def test_priority_and_moved_sequences_come_before_fairness() -> None:
    queue = FairQueue()
    queue.push("a0", (0, 1, 0), "a")
    admit(queue, 1, cost=1000.0)  # a is far ahead of b now
    queue.push("a1", (-1, 2, 0), "a")  # but it has the better priority
    queue.push("b0", (0, 3, 0), "b")
    queue.push("a-moved", (0, -1, 0), "a")  # moved here mid-stream: ahead of its priority's queue
    assert queue.peek(3) == ["a1", "a-moved", "b0"]
    assert admit(queue, 3) == ["a1", "a-moved", "b0"]


def test_requeue_and_remove_keep_the_queue_whole() -> None:
    queue = FairQueue()
    queue.push("a0", (0, 0, 0), "a")
    queue.push("b0", (0, 1, 0), "b")
    queue.push("b1", (0, 2, 0), "b")
    first = queue.pop()
    queue.requeue(first)  # not admitted: back in its place, nobody charged
    queue.check_integrity()
    assert queue.peek(3) == ["a0", "b0", "b1"]
    queue.remove("b0")
    queue.check_integrity()
    assert set(queue) == {"a0", "b1"} and "b0" not in queue
    queue.clear()
    queue.check_integrity()
    assert len(queue) == 0


def tenant_seq(seq_id: str, tenant: str, prompt_len: int = 3, first_token: int = 10) -> Sequence:
    """A sequence whose prompt starts at ``first_token``: distinct prompts share no cached prefix."""
    params = make_seq(seq_id, max_tokens=2).sampling_params
    prompt = list(range(first_token, first_token + prompt_len))
    return Sequence(seq_id, "gw", prompt, params, EOS, tenant=tenant)


def admissions(sched: WorkerScheduler, num: int) -> list[str]:
    """The first ``num`` sequences the core admits, each ending at once (its slot frees)."""
    admitted: list[str] = []
    while len(admitted) < num:
        plan = sched.schedule()
        sched.check_integrity()
        admitted += [s.seq_id for s in plan.new_seqs]
        ids = tuple(s.seq_id for s in plan.new_seqs) + plan.seq_ids
        sched.postprocess(ids, [EOS] * len(ids))
        sched.check_integrity()
    return admitted[:num]


def test_the_core_admits_a_small_tenant_between_a_floods_requests() -> None:
    sched = make_scheduler(max_num_seqs=1, max_num_waiting=16)
    for i in range(6):
        sched.add(tenant_seq(f"flood{i}", "flood"))
    sched.add(tenant_seq("small", "small"))
    admitted = admissions(sched, 7)
    assert admitted.index("small") <= 1, admitted


def test_newcomers_do_not_starve_a_waiting_tenant_and_idle_ones_are_forgotten() -> None:
    queue = FairQueue(max_idle_tenants=8)
    queue.push("a0", (0, 0, 0), "a")
    queue.push("a1", (0, 1, 0), "a")
    admit(queue, 1, cost=1000.0)  # a is far ahead; a1 waits
    popped = []
    for i in range(50):  # one-shot tenants (random API keys), one arriving per admission
        queue.push(f"n{i}", (0, 2 + i, 0), f"new{i}")
        popped += admit(queue, 1)
        queue.check_integrity()
        if "a1" in popped:
            break
    # a newcomer starts where the least-served waiting tenant is (a, at 1000): a1, older, goes first
    assert popped[0] == "a1", popped
    for i in range(50, 100):
        queue.push(f"n{i}", (0, 2 + i, 0), f"new{i}")
        admit(queue, 1)
    queue.check_integrity()
    assert len(queue._vtime) - len(queue._queues) <= 8  # idle tenants' times are not kept without bound


def test_the_core_charges_tokens_not_requests() -> None:
    sched = make_scheduler(max_num_seqs=1, max_num_waiting=64, max_model_len=128, num_blocks=128)
    for i in range(6):
        sched.add(tenant_seq(f"big{i}", "big", 40, first_token=1000 + 100 * i))
    for i in range(30):
        sched.add(tenant_seq(f"small{i}", "small", 4, first_token=5000 + 100 * i))
    admitted = admissions(sched, 18)
    # one 40-token prompt costs what ten 4-token ones do: ~10 small admissions per big one
    num_big = sum(s.startswith("big") for s in admitted)
    assert 1 <= num_big <= 3, admitted
