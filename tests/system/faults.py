"""Fault harness for system tests: a real stack whose processes are found by role and hurt for
real (kill -9, SIGSTOP/SIGCONT, a restart with the same arguments, nats-server restarted on its
port and JetStream store), streams read to a deadline and classified by how they ended, the time
until the stack serves again, and the processes the harness started that are still running.

Roles: ``kvcache``, ``worker``, ``scheduler``, ``gateway`` (the processes ``deepinfer <role>``)
and ``nats-server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Literal

import httpx
import psutil

from libs.bus.nats_server import free_port
from tests.system.stack import READY_TIMEOUT_S, Stack, spawn, wait_healthy
from tests.system.stream_end import ApiName, Kind, StreamEnd, StreamState

Role = Literal["kvcache", "worker", "scheduler", "gateway", "nats-server"]
NATS: Role = "nats-server"
MODEL = "SmolLM2-135M-Instruct"
API_PATHS: dict[ApiName, str] = {
    "chat": "/chat/completions",
    "completions": "/completions",
    "messages": "/messages",
    "responses": "/responses",
}
PING = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
__all__ = ["Faults", "InFlight", "Kind", "StreamEnd", "resume_path"]


def resume_path(api: ApiName, request_id: str, last_event_id: int) -> tuple[str, dict[str, str]]:
    """The GET that resumes ``request_id``'s stream after event ``last_event_id`` (path, headers)."""
    if api == "responses":
        return f"/responses/{request_id}?stream=true&starting_after={last_event_id}", {}
    return f"{API_PATHS[api]}/{request_id}?stream=true", {"Last-Event-ID": str(last_event_id)}


class InFlight:
    """One streamed request read in its own thread until its last event, a drop, or ``deadline_s``.

    ``mark()`` restarts the clock (at the fault), so ``result().seconds`` is the time from the fault
    to the end; ``state`` shows the tokens, request id and last event id seen so far."""

    def __init__(
        self,
        base_url: str,
        api: ApiName,
        body: dict[str, Any] | None,
        deadline_s: float,
        path: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.base_url, self.api, self.deadline_s = base_url, api, deadline_s
        self.method = "POST" if body is not None else "GET"
        self.body = None if body is None else {**body, "stream": True}
        self.path = path or API_PATHS[api]
        self.headers = headers or {}
        self.state = StreamState(api)
        self.clock = time.monotonic()
        self._end: StreamEnd | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    def mark(self) -> None:
        self.clock = time.monotonic()

    def wait_tokens(self, num_tokens: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.state.num_tokens < num_tokens:
            if self._end is not None:
                raise AssertionError(f"the stream ended before {num_tokens} tokens: {self._end}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {num_tokens} tokens within {timeout_s} s")
            time.sleep(0.02)

    @property
    def done(self) -> bool:
        return self._end is not None

    def result(self) -> StreamEnd:
        self._thread.join()
        assert self._end is not None
        return self._end

    def _finish(self, kind: Kind, detail: str) -> None:
        self._end = StreamEnd(kind, detail, self.state.num_tokens, time.monotonic() - self.clock)

    async def _run(self) -> None:
        try:
            await asyncio.wait_for(self._read(), self.deadline_s)
        except TimeoutError:
            self._finish("deadline", f"no end within {self.deadline_s} s ({self.state.num_tokens} tokens)")

    async def _read(self) -> None:
        timeout = httpx.Timeout(10.0, read=None)
        try:
            async with (
                httpx.AsyncClient(base_url=self.base_url, timeout=timeout) as http,
                http.stream(self.method, self.path, json=self.body, headers=self.headers) as resp,
            ):
                if resp.status_code != 200:
                    body = await resp.aread()
                    self._finish("http_error", f"{resp.status_code}: {body[:300]!r}")
                    return
                async for chunk in resp.aiter_raw():
                    self.state.feed(chunk)
                    if self.state.verdict is not None:
                        break
                self._finish(*self.state.end("EOF"))
        except httpx.TransportError as exc:
            self._finish(*self.state.end(f"{type(exc).__name__}: {exc}"))


class Faults:
    """A running stack and what the harness does to it; ``close()`` stops everything it started."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self._started: list[tuple[str, psutil.Process]] = []
        self._extra: list[subprocess.Popen[bytes]] = []  # services beside the stack's own
        for proc in stack.procs:
            self._track(self.role_of(proc), proc.pid)
        assert stack.nats.pid is not None
        self._track(NATS, stack.nats.pid)

    @classmethod
    def start(cls, cache_dir: Path, log: Path) -> Faults:
        return cls(Stack.start(cache_dir, log, dtype="float32"))

    @staticmethod
    def role_of(proc: subprocess.Popen[bytes]) -> str:
        return str(proc.args[3])  # type: ignore[index]  # [python, -m, deepinfer, <role>, ...]

    def proc(self, role: Role) -> subprocess.Popen[bytes]:
        found = [p for p in self.stack.procs if self.role_of(p) == role]
        assert len(found) == 1, f"{len(found)} {role} processes"
        return found[0]

    def pid(self, role: Role) -> int:
        pid = self.stack.nats.pid if role == NATS else self.proc(role).pid
        assert pid is not None, f"no {role} running"
        return pid

    def kill9(self, role: Role) -> None:
        if role == NATS:
            self.stack.nats.kill()
            return
        proc = self.proc(role)
        self._track_children(role, proc.pid)  # orphaned now, they must still end by themselves
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop(self, role: Role) -> None:
        os.kill(self.pid(role), signal.SIGSTOP)

    def cont(self, role: Role) -> None:
        os.kill(self.pid(role), signal.SIGCONT)

    def restart(self, role: Role) -> None:
        """A fresh process of ``role`` with the same arguments (the old one killed if still alive);
        nats-server comes back on the same port and JetStream store directory."""
        if role == NATS:
            self.stack.nats.kill()
            self.stack.nats.start()
            assert self.stack.nats.pid is not None
            self._track(NATS, self.stack.nats.pid)
            return
        old = self.proc(role)
        if old.poll() is None:
            self._track_children(role, old.pid)
            old.send_signal(signal.SIGKILL)
            old.wait()
        if role == "worker":  # the stack's own spawners keep its worker and scheduler fields current
            new = self.stack.spawn_worker()
        elif role == "scheduler":
            new = self.stack.spawn_scheduler()
        else:
            new = spawn(role, *old.args[4:], log=self.stack.log)  # type: ignore[index]
            self.stack.procs[self.stack.procs.index(old)] = new
        assert self.role_of(new) == role and old not in self.stack.procs
        self._track(role, new.pid)

    def extra_gateway(self) -> tuple[subprocess.Popen[bytes], str]:
        """Another gateway on the stack's NATS, on a free port, once it is healthy: (process, base URL)."""
        port = free_port()
        proc = self.stack.spawn_gateway(port)
        self._extra.append(proc)
        self._track("gateway", proc.pid)
        wait_healthy(f"http://127.0.0.1:{port}/health", [proc], self.stack.log, READY_TIMEOUT_S)
        return proc, f"http://127.0.0.1:{port}/v1"

    def stream(self, api: ApiName, body: dict[str, Any], deadline_s: float) -> InFlight:
        return InFlight(self.stack.base_url, api, body, deadline_s)

    def resume(self, api: ApiName, request_id: str, last_event_id: int, deadline_s: float) -> InFlight:
        path, headers = resume_path(api, request_id, last_event_id)
        return InFlight(self.stack.base_url, api, None, deadline_s, path, headers)

    def wait_serving(self, timeout_s: float) -> float:
        """Seconds until a real request (a short greedy chat) succeeds; TimeoutError past ``timeout_s``."""
        start = time.monotonic()
        last = ""
        while (remaining := timeout_s - (time.monotonic() - start)) > 0:
            try:
                resp = httpx.post(f"{self.stack.base_url}/chat/completions", json=PING, timeout=remaining)
                if resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] in (
                    "stop",
                    "length",
                ):
                    return time.monotonic() - start
                last = f"{resp.status_code}: {resp.text[:300]}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.25)
        raise TimeoutError(f"not serving within {timeout_s} s; last: {last}")

    def leftover_processes(self, grace_s: float = 10.0) -> list[str]:
        """Every process the harness started (or that they started) still running after ``grace_s``
        (a child sees its parent gone only when it next reads from it)."""
        deadline = time.monotonic() + grace_s
        while (left := [(role, proc) for role, proc in self._started if _alive(proc)]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.1)
        return [
            f"{role} pid {proc.pid}: {' '.join(proc.cmdline())[:200]}" for role, proc in left if _alive(proc)
        ]

    def close(self) -> None:
        for role, proc in list(self._started):
            if _alive(proc):
                self._track_children(role, proc.pid)
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(signal.SIGCONT)  # a stopped process would not act on SIGTERM
        for proc in self._extra:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.stack.stop()

    def _track_children(self, role: str, pid: int) -> None:
        with contextlib.suppress(psutil.Error):
            children = psutil.Process(pid).children(recursive=True)
            self._started += [(f"{role} child", child) for child in children]

    def _track(self, role: str, pid: int) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            self._started.append((role, psutil.Process(pid)))


def _alive(proc: psutil.Process) -> bool:
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
