"""Faults seen by heartbeat, on a stack of its own: kill -9 of the scheduler, kill -9 of the worker,
a SIGSTOP'd worker, nats-server killed and started again on its port and store.

With two streams in flight at the fault, each stream ends within 30 s with an error event naming
the component, /health turns 503 within 10 s, and once the part is back (a new process, SIGCONT,
the server restarted) /health is 200 again and a new request succeeds. The faults run in sequence
on one stack, each test leaving it whole for the next.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.system.stack import READY_TIMEOUT_S, Stack

MODEL = "SmolLM2-135M-Instruct"
STREAM = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}],
    "max_tokens": 2000,
    "temperature": 0.7,
    "seed": 3,
    "stream": True,
}
PING = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
STREAM_END_S = 30.0  # every stream ends this soon after any fault
UNHEALTHY_S = 10.0  # /health says 503 this soon after the stack cannot serve
NATS_DOWN_S = 8.0


@dataclass(frozen=True)
class Ended:
    at: float  # monotonic
    error: str  # the error event's message; "" if the stream completed


@pytest.fixture(scope="module")
def stack(model_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log = tmp_path_factory.mktemp("liveness") / "stack.log"
    running = Stack.start(model_cache_dir, log, dtype="float32")
    yield running
    for proc in running.procs:  # a stopped process would not act on SIGTERM
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
    running.stop()


async def open_stream(http: httpx.AsyncClient) -> asyncio.Task[Ended]:
    """A streamed chat, returned once its first token has arrived: the task reads it to its end."""
    first_token = asyncio.Event()

    async def read() -> Ended:
        error = ""
        async with http.stream("POST", "/v1/chat/completions", json=STREAM) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    error = event["error"]["message"]
                elif event.get("choices"):
                    first_token.set()
        return Ended(time.monotonic(), error)

    task = asyncio.create_task(read())
    waiter = asyncio.create_task(first_token.wait())
    await asyncio.wait({task, waiter}, timeout=120, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    assert first_token.is_set(), f"no first token: {task.result() if task.done() else 'timed out'}"
    return task


async def health_becomes(http: httpx.AsyncClient, status: int, timeout_s: float) -> float:
    """The monotonic time /health first answered ``status``; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            resp = await http.get("/health", timeout=5)
            if resp.status_code == status:
                return time.monotonic()
            last = f"{resp.status_code} {resp.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        await asyncio.sleep(0.2)
    raise AssertionError(f"/health not {status} within {timeout_s} s; last: {last}")


def survive(stack: Stack, fault: Callable[[], None], names: str, recover: Callable[[], None]) -> None:
    """Two streams in flight, then ``fault``: both end with an error naming ``names`` within
    STREAM_END_S and /health turns 503 within UNHEALTHY_S; after ``recover`` it serves again."""

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=stack.root_url, timeout=httpx.Timeout(10, read=120)) as http:
            streams = [await open_stream(http) for _ in range(2)]
            fault_at = time.monotonic()
            await asyncio.to_thread(fault)
            unhealthy_at = await health_becomes(http, 503, UNHEALTHY_S + 20)
            done, _ = await asyncio.wait(streams, timeout=STREAM_END_S + 30)
            assert len(done) == 2, "a stream did not end"
            ends = [task.result() for task in streams]
            assert unhealthy_at - fault_at <= UNHEALTHY_S, unhealthy_at - fault_at
            for end in ends:
                assert names in end.error, end
                assert end.at - fault_at <= STREAM_END_S, end.at - fault_at
            await asyncio.to_thread(recover)
            await health_becomes(http, 200, READY_TIMEOUT_S)
            resp = await http.post("/v1/chat/completions", json=PING, timeout=120)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length")

    asyncio.run(scenario())


def kill9(proc: subprocess.Popen[bytes] | None) -> None:
    assert proc is not None and proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_a_scheduler_killed_ends_its_streams_and_a_new_one_serves(stack: Stack) -> None:
    survive(stack, lambda: kill9(stack.scheduler), "scheduler", stack.spawn_scheduler)


def test_a_worker_killed_ends_its_streams_and_a_new_one_serves(stack: Stack) -> None:
    survive(stack, lambda: kill9(stack.worker), f"worker {stack.worker_id} lost", stack.spawn_worker)


def test_a_stopped_worker_is_dropped_and_rejoins_when_continued(stack: Stack) -> None:
    worker = stack.worker
    assert worker is not None

    def resume() -> None:
        os.kill(worker.pid, signal.SIGCONT)

    survive(stack, lambda: os.kill(worker.pid, signal.SIGSTOP), f"worker {stack.worker_id} lost", resume)
    assert worker.poll() is None  # the same process serves again


def test_nats_restarted_on_its_store_every_service_reconnects(stack: Stack) -> None:
    ask = {"model": MODEL, "input": "Hi", "temperature": 0, "max_output_tokens": 4}
    stored = httpx.post(f"{stack.base_url}/responses", json=ask, timeout=120)
    assert stored.status_code == 200, stored.text
    num_lines_before = len(stack.log.read_text().splitlines())
    log_lines_down: list[int] = []

    def restart() -> None:
        time.sleep(max(0.0, NATS_DOWN_S - 4))  # down for a while: reconnect attempts pile up
        log_lines_down.append(len(stack.log.read_text().splitlines()) - num_lines_before)
        stack.nats.start()

    survive(stack, stack.nats.kill, "NATS", restart)
    # A few lines per process for the outage (lost, failed requests, back), not one per attempt.
    assert log_lines_down[0] < 60, stack.log.read_text().splitlines()[num_lines_before:][:80]
    # JetStream kept its state: the stored response is still there.
    again = httpx.get(f"{stack.base_url}/responses/{stored.json()['id']}", timeout=30)
    assert again.status_code == 200 and again.json()["output"] == stored.json()["output"], again.text
