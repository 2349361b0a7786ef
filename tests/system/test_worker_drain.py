"""SIGTERM drains a worker, on a stack of its own with two workers (real processes, real
nats-server, the real model): the worker says ``draining`` in its load at once, and one with no
streams on it leaves the members bucket within seconds and exits 0 while the other worker goes on
serving."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from libs.bus.base import Message
from libs.bus.membership import live_members
from libs.bus.nats_bus import NatsBus
from libs.protocol.codec import decode
from libs.protocol.member_messages import MemberKind, WorkerLoad
from libs.protocol.subjects import Subjects
from tests.system.stack import READY_TIMEOUT_S, Stack

MODEL = "SmolLM2-135M-Instruct"
PING = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
SECOND_WORKER = "worker-test-2"
LEAVE_S = 5.0  # a worker holding nothing is out of the members bucket this soon after SIGTERM
SUBJECTS = Subjects()


async def worker_ids(nats_url: str) -> set[str]:
    bus = await NatsBus.connect(nats_url, name="system-test")
    try:
        return {m.member_id for m in await live_members(bus, SUBJECTS.members_bucket, MemberKind.WORKER)}
    finally:
        await bus.close()


async def wait_workers(nats_url: str, ok: set[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (ids := await worker_ids(nats_url)) != ok:
        if time.monotonic() > deadline:
            raise AssertionError(f"workers {sorted(ids)}, not {sorted(ok)}, after {timeout_s:.0f} s")
        await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
def stack(model_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log = tmp_path_factory.mktemp("drain") / "stack.log"
    running = Stack.start(model_cache_dir, log, dtype="float32")
    try:
        running.add_worker(SECOND_WORKER)
        asyncio.run(wait_workers(running.nats.url, {running.worker_id, SECOND_WORKER}, READY_TIMEOUT_S))
        yield running
    finally:
        running.stop()


async def sigterm_and_watch(stack: Stack, pid: int) -> list[WorkerLoad]:
    """SIGTERM to the second worker (pid ``pid``); its load reports until it is out of the members
    bucket, which fails after ``LEAVE_S``."""
    bus = await NatsBus.connect(stack.nats.url, name="system-test")
    loads: list[WorkerLoad] = []

    async def on_load(msg: Message) -> None:
        loads.append(decode(WorkerLoad, msg.data))

    try:
        await bus.subscribe(SUBJECTS.load(SECOND_WORKER), on_load)
        async with asyncio.timeout(10):  # a periodic report (every 0.5 s): the subscription is live
            while not loads:
                await asyncio.sleep(0.05)
        assert not any(load.draining for load in loads)
        os.kill(pid, signal.SIGTERM)
        await wait_workers(stack.nats.url, {stack.worker_id}, LEAVE_S)
        return loads
    finally:
        await bus.close()


def test_sigterm_to_an_idle_worker_drains_it_out_while_the_other_serves(stack: Stack) -> None:
    with httpx.Client(base_url=stack.base_url, timeout=60) as http:
        assert http.post("/chat/completions", json=PING).status_code == 200
        second = stack.procs[-1]
        loads = asyncio.run(sigterm_and_watch(stack, second.pid))
        assert second.wait(30) == 0  # its stop (G3 writer, NATS drain) on a loaded machine
        # The drain was said at once, before the worker left (it held nothing, so it did not wait).
        assert any(load.draining for load in loads), loads
        log = stack.log.read_text(errors="replace")
        assert "draining: " in log and "(nothing held): 0 sequences and 0 steps left" in log
        for _ in range(3):  # served by the first worker
            resp = http.post("/chat/completions", json=PING)
            assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"], resp.text
        assert httpx.get(f"{stack.root_url}/health", timeout=5).status_code == 200
