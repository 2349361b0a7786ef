"""Streams survive the worker holding them: kill -9 of that worker moves its streams to the other
one, SIGTERM drains them to a worker that joined at run time, kill -9 of their scheduler moves
them to another scheduler replica, and the clients see no error and the same text as an
undisturbed run (fp32 greedy); a request in the batch at two worker crashes fails alone. Real
processes, real nats-server, SmolLM2.

The stack is this module's own (two workers, G3 on a fresh store); the tests run in order.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from libs.protocol.member_messages import MemberKind
from tests.system.faults import MODEL, InFlight
from tests.system.kv_metrics import scheduler_kv_stat
from tests.system.stack import Stack, latest_loads, wait_member_id
from tests.system.test_worker_drain import wait_workers

SECOND, THIRD, FOURTH, FIFTH = "worker-test-2", "worker-test-3", "worker-test-4", "worker-test-5"
REPLICA = "scheduler-test-2"
Workers = tuple[Stack, dict[str, subprocess.Popen[bytes]]]  # the stack and its live workers
MAX_TOKENS = 96  # long enough that the streams outlive a worker's start (the drain test)
STREAM_DEADLINE_S = 180.0
TOPICS = ("lighthouses", "tides", "the moon's phases")
CONTEXT = " ".join(f"Note {i}: the keeper logs the weather, the ships and the lamp." for i in range(24))


def body(topic: str) -> dict[str, Any]:
    messages = [
        {"role": "system", "content": CONTEXT},
        {"role": "user", "content": f"Tell me about {topic}."},
    ]
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return {"model": MODEL, "messages": messages, **sampling}


def answer(base_url: str, topic: str) -> str:
    resp = httpx.post(f"{base_url}/chat/completions", json=body(topic), timeout=300)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def g3_loaded_blocks(root_url: str) -> float:
    return scheduler_kv_stat(root_url, "loaded_blocks", "G3")


def running_by_worker(nats_url: str) -> dict[str, int]:
    """Each worker's last reported number of running sequences."""
    return {w: load.num_running_seqs for w, load in asyncio.run(latest_loads(nats_url)).items()}


def busiest(stack: Stack, workers: dict[str, subprocess.Popen[bytes]]) -> str:
    running = running_by_worker(stack.nats.url)
    worker_id = max(workers, key=lambda w: running.get(w, 0))
    assert running.get(worker_id, 0) > 0, f"no worker holds a stream: {running}"
    return worker_id


@pytest.fixture(scope="module")
def fleet(model_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    tmp = tmp_path_factory.mktemp("migration")
    stack = Stack.start(model_cache_dir, tmp / "stack.log", dtype="float32", kv_store=tmp / "kv-store")
    try:
        assert stack.worker is not None
        workers = {stack.worker_id: stack.worker, SECOND: stack.add_worker(SECOND)}
        asyncio.run(wait_workers(stack.nats.url, set(workers), 180))
        yield stack, workers
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def undisturbed(fleet: Workers) -> dict[str, str]:
    stack, _ = fleet
    return {topic: answer(stack.base_url, topic) for topic in TOPICS}


def stream_all(stack: Stack) -> dict[str, InFlight]:
    streams = {t: InFlight(stack.base_url, "chat", body(t), STREAM_DEADLINE_S) for t in TOPICS}
    for stream in streams.values():
        stream.wait_tokens(6, 120)
    return streams


def next_tokens_s(streams: dict[str, InFlight], kill: Callable[[], None]) -> float:
    """Seconds from ``kill`` until every stream has a token more than it had, or has ended."""
    counts = {t: s.state.num_tokens for t, s in streams.items()}
    killed = time.monotonic()
    kill()
    resumed: dict[str, float] = {}  # the moved streams are the last to go on
    while len(resumed) < len(streams):
        for t, s in streams.items():
            if t not in resumed and (s.state.num_tokens > counts[t] or s.done):
                resumed[t] = time.monotonic() - killed
        time.sleep(0.01)
    return max(resumed.values())


def assert_undisturbed(streams: dict[str, InFlight], undisturbed: dict[str, str]) -> None:
    for topic, stream in streams.items():
        end = stream.result()
        assert end.kind == "completed", (topic, end)
        assert stream.state.text == undisturbed[topic], topic


def test_kill_9_of_the_worker_holding_streams_moves_them(fleet: Workers, undisturbed: dict[str, str]) -> None:
    stack, workers = fleet
    loaded_before = g3_loaded_blocks(stack.root_url)
    streams = stream_all(stack)
    victim = busiest(stack, workers)
    seconds = next_tokens_s(streams, workers.pop(victim).kill)
    print(f"kill -9 of {victim} -> every stream's next token within {seconds:.2f} s")
    assert_undisturbed(streams, undisturbed)
    log = stack.log.read_text()
    assert f"worker {victim} lost" in log and "moved" in log
    # The moved streams' prompt blocks came from the shared store, not from a recompute.
    assert g3_loaded_blocks(stack.root_url) > loaded_before


def test_sigterm_drains_streams_to_a_worker_that_joined_at_run_time(
    fleet: Workers, undisturbed: dict[str, str]
) -> None:
    """The newcomer starts before the streams and is held out of the fleet by SIGSTOP until they
    run: had it started then, they could finish while it loads and leave nothing to drain."""
    stack, workers = fleet
    (remaining,) = workers
    third = workers[THIRD] = stack.add_worker(THIRD)
    asyncio.run(wait_workers(stack.nats.url, {remaining, THIRD}, 180))
    os.kill(third.pid, signal.SIGSTOP)  # dropped when its heartbeat lapses
    asyncio.run(wait_workers(stack.nats.url, {remaining}, 60))
    streams = stream_all(stack)  # all on the one worker left
    os.kill(third.pid, signal.SIGCONT)  # it joins again within a heartbeat
    asyncio.run(wait_workers(stack.nats.url, {remaining, THIRD}, 60))
    proc = workers.pop(remaining)
    started = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    assert_undisturbed(streams, undisturbed)
    assert proc.wait(60) == 0
    log = stack.log.read_text()
    assert f"worker {remaining} drains: moved" in log, log[-3000:]
    assert time.monotonic() - started < 60
    assert answer(stack.base_url, TOPICS[0]) == undisturbed[TOPICS[0]]  # served by the newcomer


def test_a_request_in_the_batch_at_two_worker_crashes_fails_alone(fleet: Workers) -> None:
    """The poison (P) is in the batch each time a worker dies; the canary (C) only the second
    time. P fails at its second crash with an error saying so; C moves on and finishes with the
    text it has undisturbed. The worker C moves to starts first and is held out of the fleet by
    SIGSTOP until P and C share a batch: had it started then, P and C could finish while it
    loads."""
    stack, workers = fleet
    (first,) = workers
    workers[FOURTH] = stack.add_worker(FOURTH)
    fifth = workers[FIFTH] = stack.add_worker(FIFTH)
    asyncio.run(wait_workers(stack.nats.url, set(workers), 180))
    os.kill(fifth.pid, signal.SIGSTOP)  # dropped when its heartbeat lapses
    asyncio.run(wait_workers(stack.nats.url, {first, FOURTH}, 60))
    # Long enough that both still run when the stopped worker is back (a heartbeat or two).
    long_run = {"max_tokens": 480, "temperature": 0, "ignore_eos": True, "model": MODEL}
    poison_body = {"messages": [{"role": "user", "content": "Count from one."}], **long_run}
    canary_body = {"messages": [{"role": "user", "content": "Name some rivers."}], **long_run}
    poison = InFlight(stack.base_url, "chat", poison_body, STREAM_DEADLINE_S)
    poison.wait_tokens(4, 120)
    assert running_by_worker(stack.nats.url).get(first) == 1  # P: the lowest id
    # A tenant of its own: P's worker holds nothing C could reuse, so C goes to the idle one.
    auth = {"Authorization": "Bearer canary"}
    canary = InFlight(stack.base_url, "chat", canary_body, STREAM_DEADLINE_S, headers=auth)
    canary.wait_tokens(4, 120)
    assert running_by_worker(stack.nats.url).get(FOURTH) == 1
    workers.pop(first).kill()  # crash 1: P in the batch
    poison.wait_tokens(poison.state.num_tokens + 4, 60)  # P runs beside C now
    os.kill(fifth.pid, signal.SIGCONT)  # it rejoins within a heartbeat
    asyncio.run(wait_workers(stack.nats.url, {FOURTH, FIFTH}, 60))
    assert running_by_worker(stack.nats.url).get(FOURTH) == 2
    workers.pop(FOURTH).kill()  # crash 2: P and C in the batch
    end = poison.result()
    assert end.kind == "error_event" and "in the batch at 2 worker crashes" in end.detail, end
    assert canary.result().kind == "completed"
    undisturbed = httpx.post(f"{stack.base_url}/chat/completions", json=canary_body, timeout=300)
    assert canary.state.text == undisturbed.json()["choices"][0]["message"]["content"]


def test_kill_9_of_the_scheduler_moves_its_streams_to_another_replica(
    fleet: Workers, undisturbed: dict[str, str]
) -> None:
    """The streams run on the stack's scheduler, which owns the one worker left; a second replica
    joins, then the first is killed. The gateway resubmits each stream with the tokens it has to
    the second, which claims the worker once it let the dead owner go: no error, the same text,
    and the prompts' blocks loaded from the tiers, not recomputed."""
    stack, _workers = fleet
    assert stack.scheduler is not None
    streams = stream_all(stack)
    stack.add_scheduler(REPLICA)
    asyncio.run(wait_member_id(stack.nats.url, MemberKind.SCHEDULER, REPLICA, 120))
    seconds = next_tokens_s(streams, stack.scheduler.kill)
    print(f"kill -9 of the scheduler -> every stream's next token within {seconds:.2f} s")
    assert_undisturbed(streams, undisturbed)
    log = stack.log.read_text()
    assert log.count(f"moved to scheduler {REPLICA}") == len(TOPICS), log[-3000:]
    loaded = sum(scheduler_kv_stat(stack.root_url, "loaded_blocks", tier, REPLICA) for tier in ("G2", "G3"))
    assert loaded > 0
    assert answer(stack.base_url, TOPICS[0]) == undisturbed[TOPICS[0]]  # the replica serves new ones
