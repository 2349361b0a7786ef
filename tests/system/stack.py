"""Start the real stack for system tests: nats-server, worker, scheduler, kvcache and gateway processes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer import serve
from libs.bus.base import Message
from libs.bus.membership import live_members
from libs.bus.nats_bus import NatsBus
from libs.bus.nats_server import EmbeddedNatsServer, free_port
from libs.protocol.codec import decode
from libs.protocol.member_messages import MemberKind, WorkerLoad
from libs.protocol.subjects import Subjects

READY_TIMEOUT_S = 180.0
RESUME_GRACE_S = 5.0  # a client that drops has this long to resume before its request is cancelled


def spawn(command: str, *args: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "deepinfer", command, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], log: Path, timeout_s: float) -> None:
    """deepinfer.serve.wait_healthy, with the end of ``log`` in the error."""
    try:
        serve.wait_healthy(url, procs, timeout_s)
    except serve.ChildExited as exc:
        raise RuntimeError(f"{exc}:\n{log.read_text()[-4000:]}") from exc
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}:\n{log.read_text()[-4000:]}") from exc


@dataclass
class Stack:
    """One running stack; ``base_url`` ends in /v1."""

    nats: EmbeddedNatsServer
    port: int
    worker_id: str
    log: Path
    cache_dir: Path
    kv_store: Path  # G3: block files, kept across a stop and a start on the same path
    dtype: str = "float32"
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    worker: subprocess.Popen[bytes] | None = None  # the latest worker and scheduler spawned
    scheduler: subprocess.Popen[bytes] | None = None
    worker_args: tuple[str, ...] = ()  # more flags for the stack's worker and its replacements
    scheduler_args: tuple[str, ...] = ()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(
        cls,
        cache_dir: Path,
        log: Path,
        dtype: str = "float32",
        kv_store: Path | None = None,
        worker_args: tuple[str, ...] = (),
        scheduler_args: tuple[str, ...] = (),
    ) -> Stack:
        nats = EmbeddedNatsServer()
        nats.start()
        kv_store = kv_store or cache_dir / "kv-store"
        stack = cls(nats, free_port(), "worker-test", log, cache_dir, kv_store, dtype)
        stack.worker_args, stack.scheduler_args = worker_args, scheduler_args
        common = ("--nats-url", nats.url, "--log-level", "info")
        store = ("--kv-store-path", str(kv_store))
        try:
            stack.procs = [spawn("kvcache", *common, *store, "--cache-dir", str(cache_dir), log=log)]
            stack.spawn_worker()
            stack.spawn_scheduler()
            stack.procs.append(stack.spawn_gateway(stack.port))
            wait_healthy(f"{stack.root_url}/health", stack.procs, log, READY_TIMEOUT_S)
            # /health needs a scheduler and a worker; G3 lookups need the kvcache's index loaded,
            # which it announces only once it has.
            asyncio.run(wait_member(nats.url, MemberKind.KVCACHE, READY_TIMEOUT_S))
        except BaseException:
            stack.stop()
            raise
        return stack

    def spawn_worker(self) -> subprocess.Popen[bytes]:
        """A worker process (id ``worker_id``): the stack's first, or a replacement for a dead one."""
        old, self.worker = (
            self.worker,
            spawn(
                "worker",
                *("--nats-url", self.nats.url, "--log-level", "info", "--worker-id", self.worker_id),
                *("--dtype", self.dtype, "--cache-dir", str(self.cache_dir), "--kv-cache-gb", "0.5"),
                *("--max-num-seqs", "16", "--kv-store-path", str(self.kv_store)),
                *self.worker_args,
                log=self.log,
            ),
        )
        return self._replace(old, self.worker)

    def add_worker(self, worker_id: str, *args: str) -> subprocess.Popen[bytes]:
        """One more worker process, like ``spawn_worker``'s but with id ``worker_id`` and flags
        ``args``; it replaces none."""
        proc = spawn(
            "worker",
            *("--nats-url", self.nats.url, "--log-level", "info", "--worker-id", worker_id),
            *("--dtype", self.dtype, "--cache-dir", str(self.cache_dir), "--kv-cache-gb", "0.5"),
            *("--max-num-seqs", "16", "--kv-store-path", str(self.kv_store)),
            *args,
            log=self.log,
        )
        self.procs.append(proc)
        return proc

    def spawn_scheduler(self) -> subprocess.Popen[bytes]:
        """A scheduler process: the stack's first, or a replacement for a dead one."""
        # Overlap on: the harder path (two plans in flight over real NATS); serve's test runs
        # the default. Stats often, so /metrics shows a request's hits soon after it ends.
        old, self.scheduler = (
            self.scheduler,
            spawn(
                "scheduler",
                *("--nats-url", self.nats.url, "--log-level", "info"),
                *("--overlap", "true", "--kv-stats-interval-s", "0.2"),
                *self.scheduler_args,
                log=self.log,
            ),
        )
        return self._replace(old, self.scheduler)

    def add_scheduler(self, scheduler_id: str) -> subprocess.Popen[bytes]:
        """One more scheduler replica, like ``spawn_scheduler``'s, with id ``scheduler_id``; it
        replaces none."""
        proc = spawn(
            "scheduler",
            *("--nats-url", self.nats.url, "--log-level", "info", "--scheduler-id", scheduler_id),
            *("--overlap", "true", "--kv-stats-interval-s", "0.2"),
            *self.scheduler_args,
            log=self.log,
        )
        self.procs.append(proc)
        return proc

    def _replace(
        self, old: subprocess.Popen[bytes] | None, new: subprocess.Popen[bytes]
    ) -> subprocess.Popen[bytes]:
        """``procs`` holds one process per role: a replacement takes its predecessor's place."""
        if old in self.procs:
            self.procs[self.procs.index(old)] = new
        else:
            self.procs.append(new)
        return new

    def restart_nats(self, down_s: float) -> None:
        """kill -9 nats-server, leave it down ``down_s``, start it again on its port and store."""
        self.nats.kill()
        time.sleep(down_s)
        self.nats.start()

    def spawn_gateway(self, port: int, *args: str) -> subprocess.Popen[bytes]:
        """A gateway process on this stack's NATS (the stack's own, or another for restart tests),
        with more flags ``args``."""
        return spawn(
            "gateway",
            *("--nats-url", self.nats.url, "--log-level", "info", "--port", str(port)),
            *("--cache-dir", str(self.cache_dir), "--resume-grace-s", str(RESUME_GRACE_S)),
            *args,
            log=self.log,
        )

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.nats.stop()


async def wait_member(nats_url: str, kind: MemberKind, timeout_s: float) -> None:
    bus = await NatsBus.connect(nats_url, name="system-test")
    try:
        deadline = time.monotonic() + timeout_s
        while not await live_members(bus, Subjects().members_bucket, kind):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {kind.name} member within {timeout_s} s")
            await asyncio.sleep(0.1)
    finally:
        await bus.close()


async def latest_loads(nats_url: str, listen_s: float = 1.5) -> dict[str, WorkerLoad]:
    """Each worker's last load report over ``listen_s`` (they come after each step, and twice a
    second while idle)."""
    bus = await NatsBus.connect(nats_url, name="system-test")
    loads: dict[str, WorkerLoad] = {}

    async def on_load(msg: Message) -> None:
        load = decode(WorkerLoad, msg.data)
        loads[load.worker_id] = load

    try:
        await bus.subscribe(Subjects().load_all, on_load)
        await asyncio.sleep(listen_s)
        return loads
    finally:
        await bus.close()


async def wait_member_id(nats_url: str, kind: MemberKind, member_id: str, timeout_s: float) -> None:
    """Until ``member_id`` heartbeats in the members bucket."""
    bus = await NatsBus.connect(nats_url, name="system-test")
    try:
        deadline = time.monotonic() + timeout_s
        while all(m.member_id != member_id for m in await live_members(bus, Subjects().members_bucket, kind)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{kind.name} {member_id} not a member within {timeout_s} s")
            await asyncio.sleep(0.1)
    finally:
        await bus.close()
