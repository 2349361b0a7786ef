"""Start the real stack for system tests: nats-server, worker, scheduler and gateway processes."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer import serve
from libs.bus.nats_server import EmbeddedNatsServer, free_port

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
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, cache_dir: Path, log: Path, dtype: str = "float32") -> Stack:
        nats = EmbeddedNatsServer()
        nats.start()
        stack = cls(nats, free_port(), "worker-test", log, cache_dir)
        common = ("--nats-url", nats.url, "--log-level", "info")
        try:
            stack.procs = [
                spawn(
                    "worker",
                    *common,
                    "--worker-id",
                    stack.worker_id,
                    "--dtype",
                    dtype,
                    "--cache-dir",
                    str(cache_dir),
                    "--kv-cache-gb",
                    "0.5",
                    "--max-num-seqs",
                    "16",
                    log=log,
                ),
                # Overlap on: the harder path (two plans in flight over real NATS); serve's test runs
                # the default.
                spawn("scheduler", *common, "--overlap", "true", log=log),
                stack.spawn_gateway(stack.port),
            ]
            wait_healthy(f"{stack.root_url}/health", stack.procs, log, READY_TIMEOUT_S)
        except BaseException:
            stack.stop()
            raise
        return stack

    def spawn_gateway(self, port: int) -> subprocess.Popen[bytes]:
        """A gateway process on this stack's NATS (the stack's own, or another for restart tests)."""
        return spawn(
            "gateway",
            *("--nats-url", self.nats.url, "--log-level", "info", "--port", str(port)),
            *("--cache-dir", str(self.cache_dir), "--resume-grace-s", str(RESUME_GRACE_S)),
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
