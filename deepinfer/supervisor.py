"""The processes ``deepinfer serve`` supervises: start, notice a death (and reap it), restart, stop.

A service process is ``python -m deepinfer <service> <flags of its Config>``; the embedded
nats-server is restarted on its port and JetStream store, so clients reconnect to the same URL.
A restarted service gets fresh ids (``worker-1a2b-r1``): a new worker's KV pages are empty and a
new scheduler knows no sequences, so neither may pass for the process it replaces.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter

from deepinfer.restart_policy import RestartPolicy
from libs.bus.nats_server import EmbeddedNatsServer
from libs.runtime.settings import secret_env, to_argv

log = logging.getLogger("deepinfer.serve")

POLL_S = 0.1

REGISTRY = CollectorRegistry()  # serve's own /metrics (``--metrics-port``, after the services' ports)
RESTARTS = Counter(
    "deepinfer_restarts",
    "processes deepinfer serve restarted after they died",
    ["service"],
    registry=REGISTRY,
)


def _child_setup() -> None:
    """In a service child before exec: SIGKILL from the kernel when serve goes away (Linux), and
    Ctrl-C ignored until the service's event loop takes SIGINT over: a Ctrl-C that lands while it
    is still importing must not become a KeyboardInterrupt traceback (serve stops it with SIGTERM)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: a clean stop still ends every child


def renamed(config: object, incarnation: int) -> object:
    """``config`` with every ``*_id`` field suffixed ``-r<incarnation>`` (0: unchanged)."""
    if incarnation == 0:
        return config
    ids = {
        f.name: f"{getattr(config, f.name)}-r{incarnation}"
        for f in dataclasses.fields(config)  # type: ignore[arg-type]
        if f.name.endswith("_id") and isinstance(getattr(config, f.name), str)
    }
    return dataclasses.replace(config, **ids)  # type: ignore[type-var]


class Child(Protocol):
    name: str

    def start(self) -> None: ...

    def poll(self) -> int | None: ...


class ServiceChild:
    """One service process, ``python -m deepinfer <command>`` with its Config as flags; ``name``
    (in logs and the restarts metric) is the command unless several processes run it."""

    def __init__(self, name: str, config: object, command: str = "") -> None:
        self.name = name
        self.command = command or name
        self.config = config
        self.proc: subprocess.Popen[bytes] | None = None
        self.incarnation = 0

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        argv = to_argv(renamed(self.config, self.incarnation))
        preexec = _child_setup if sys.platform.startswith("linux") else None
        env = {**os.environ, **secret_env(self.config)}  # secrets stay out of the argv ps shows
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deepinfer", self.command, *argv], preexec_fn=preexec, env=env
        )
        self.incarnation += 1

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, sig: int) -> None:
        if self.proc is not None and self.alive():
            self.proc.send_signal(sig)


class NatsChild:
    """The embedded nats-server; ``start`` after a death reuses its port and store."""

    name = "nats-server"

    def __init__(self, server: EmbeddedNatsServer) -> None:
        self.server = server

    def start(self) -> None:
        self.server.start()

    def poll(self) -> int | None:
        return self.server.poll()


@dataclasses.dataclass
class Supervised:
    child: Child
    policy: RestartPolicy
    restart_at: float | None = None  # when a dead child is due to start again


class Supervisor:
    """Restarts the children that die, each under its own RestartPolicy."""

    def __init__(self, supervised: Sequence[Supervised]) -> None:
        self.supervised = list(supervised)

    def check(self, now: float) -> str | None:
        """Notice deaths and start the children whose backoff has passed; a reason to give up on
        the stack (a child past its restart limit), or None."""
        for entry in self.supervised:
            if entry.restart_at is None:
                code = entry.child.poll()  # reaps a dead child: no zombie
                if code is not None and (reason := self._died(entry, code, now)) is not None:
                    return reason
            elif now >= entry.restart_at:
                entry.restart_at = None
                try:
                    entry.child.start()
                except (OSError, RuntimeError, TimeoutError) as exc:  # nats-server that cannot start
                    log.error("%s did not start again: %s", entry.child.name, exc)
                    if (reason := self._died(entry, -1, now)) is not None:
                        return reason
                else:
                    log.warning("%s restarted", entry.child.name)
                    RESTARTS.labels(entry.child.name).inc()
        return None

    def _died(self, entry: Supervised, code: int, now: float) -> str | None:
        delay = entry.policy.on_exit(now)
        name, policy = entry.child.name, entry.policy
        if delay is None:
            return (
                f"{name} exited (code {code}) after {policy.max_restarts} restarts within "
                f"{policy.window_s:.0f} s: giving up"
            )
        log.warning(
            "%s exited (code %s): restarting it in %.1f s (restart %d of at most %d within %.0f s)",
            *(name, code, delay, policy.num_recent_deaths, policy.max_restarts, policy.window_s),
        )
        entry.restart_at = now + delay
        return None


def wait_exited(children: Sequence[ServiceChild], timeout_s: float, hurried: Callable[[], bool]) -> None:
    """Until every child has exited, ``timeout_s`` has passed, or ``hurried()``."""
    deadline = time.monotonic() + timeout_s
    while any(c.alive() for c in children) and time.monotonic() < deadline and not hurried():
        time.sleep(POLL_S)


def terminate(children: Sequence[ServiceChild], signals: Sequence[int], timeout_s: float) -> None:
    """Send each live child ``signals``, then SIGKILL the ones left after ``timeout_s``; reaps all."""
    for child in children:
        for sig in signals:
            child.send(sig)
    wait_exited(children, timeout_s, lambda: False)
    for child in children:  # all at once: a big process takes a while to tear down
        if child.alive():
            log.warning("%s did not stop in %.0f s: killing it", child.name, timeout_s)
            child.send(signal.SIGKILL)
    for child in children:
        if child.proc is not None:
            child.proc.wait()
