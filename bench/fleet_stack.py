"""What bench/fleet.py watches and starts on a fleet: the plans each worker is sent (a tap on the
step subjects), the workers' load reports, and a stack of separate processes whose workers can be
killed one by one and replaced (``deepinfer serve`` would restart a killed worker under its own id).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from libs.bus.base import Message
from libs.bus.membership import live_members
from libs.bus.nats_bus import NatsBus
from libs.bus.nats_server import EmbeddedNatsServer, free_port
from libs.protocol.codec import decode
from libs.protocol.member_messages import MemberKind, WorkerLoad
from libs.protocol.messages import SchedulerOutput
from libs.protocol.subjects import Subjects

SUBJECTS = Subjects()
TOKEN_BYTES = 4  # packed uint32


class PlanTap:
    """Every plan a scheduler sends its workers, read off their step subjects (a plain subscriber
    beside the worker's own; it never replies). Per worker: the prompt tokens it computed, i.e. the
    tokens of each sequence it was given (prompt and, after a preemption or a move, output) minus
    those whose KV it already had or loaded (``num_computed_tokens``), and the sequences it ran.

    Closed before a worker is killed: while it listens, the scheduler's liveness probe on that
    subject would not hear "no responders", so it would wait for the dead worker's heartbeat.
    """

    def __init__(self) -> None:
        self.num_computed_tokens: Counter[str] = Counter()
        self.worker_of: dict[str, str] = {}  # seq id -> the worker it was last given to
        self._bus: NatsBus | None = None

    async def open(self, nats_url: str) -> None:
        self._bus = await NatsBus.connect(nats_url, name="bench-plan-tap")
        await self._bus.subscribe(SUBJECTS.worker_step("*"), self._on_plan)

    async def close(self) -> None:
        if self._bus is not None:
            await self._bus.close()  # the connection's subscriptions go with it
            self._bus = None

    async def _on_plan(self, msg: Message) -> None:
        if not msg.data:
            return  # a liveness probe
        worker_id = msg.subject.split(".")[-2]  # <prefix>.worker.<id>.step
        plan = decode(SchedulerOutput, msg.data)
        for seq in plan.new_seqs:
            num_tokens = (len(seq.prompt_token_ids) + len(seq.output_token_ids)) // TOKEN_BYTES
            self.num_computed_tokens[worker_id] += num_tokens - seq.num_computed_tokens
            self.worker_of[seq.seq_id] = worker_id


async def worker_loads(nats_url: str, listen_s: float, num_workers: int = 0) -> dict[str, WorkerLoad]:
    """Each worker's latest load report over ``listen_s`` (they come after each step, and every
    ``--load-interval-s`` while idle); with ``num_workers``, sooner once that many have reported."""
    bus = await NatsBus.connect(nats_url, name="bench-loads")
    loads: dict[str, WorkerLoad] = {}
    enough = asyncio.Event()

    async def on_load(msg: Message) -> None:
        load = decode(WorkerLoad, msg.data)
        loads[load.worker_id] = load
        if num_workers and len(loads) >= num_workers:
            enough.set()

    try:
        await bus.subscribe(SUBJECTS.load_all, on_load)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(enough.wait(), listen_s)
        return loads
    finally:
        await bus.close()


async def wait_driven(nats_url: str, worker_id: str, timeout_s: float) -> None:
    """Until ``worker_id`` is a live member and its load names an owner (a scheduler drives it)."""
    bus = await NatsBus.connect(nats_url, name="bench-members")
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            members = await live_members(bus, SUBJECTS.members_bucket, MemberKind.WORKER)
            if any(m.member_id == worker_id for m in members):
                load = (await worker_loads(nats_url, 0.6)).get(worker_id)
                if load is not None and load.owner:
                    return
            await asyncio.sleep(0.2)
    finally:
        await bus.close()
    raise TimeoutError(f"worker {worker_id} not driven by a scheduler after {timeout_s:.0f} s")


def spawn(command: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """``deepinfer COMMAND ARGS``, its output appended to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "deepinfer", command, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


@dataclass
class ProcessFleet:
    """nats-server, a scheduler, a gateway, kvcache when G3 is on, and workers by id, each its own
    process. ``worker_args`` go to every worker (model, dtype, tiers, ...)."""

    nats: EmbeddedNatsServer
    log: Path
    worker_args: list[str]
    scheduler_args: list[str]
    gateway_args: list[str]
    kvcache_args: list[str] | None  # None: no kvcache (G3 off)
    port: int = field(default_factory=free_port)
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    services: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        common = ["--nats-url", self.nats.url]
        if self.kvcache_args is not None:
            self.services.append(spawn("kvcache", [*common, *self.kvcache_args], self.log))
        self.services.append(spawn("scheduler", [*common, *self.scheduler_args], self.log))
        port = ["--port", str(self.port)]
        self.services.append(spawn("gateway", [*common, *port, *self.gateway_args], self.log))

    def add_worker(self, worker_id: str) -> None:
        args = ["--nats-url", self.nats.url, "--worker-id", worker_id, *self.worker_args]
        self.workers[worker_id] = spawn("worker", args, self.log)

    def kill_worker(self, worker_id: str) -> None:
        """kill -9 by pid."""
        proc = self.workers.pop(worker_id)
        proc.kill()
        proc.wait()

    def processes(self) -> list[subprocess.Popen[bytes]]:
        return [*self.services, *self.workers.values()]

    def stop(self) -> None:
        procs = self.processes()
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
