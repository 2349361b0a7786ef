"""A real ``deepinfer serve`` process for system tests, and what it leaves behind.

serve runs in a session of its own (its pid is its process group and session id), so a test can
send Ctrl-C to the whole group as a terminal would, and find every service process it started by
session id. The embedded nats-server has a session of its own too; with ``TMPDIR`` set to the
test's directory its JetStream store, and so its command line, is under that directory.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from libs.bus.nats_server import free_port

TINY = ("--kv-cache-gb", "0.25", "--host-cache-gb", "0.05", "--dtype", "float32", "--max-num-seqs", "4")
MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Serve:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    tmp: Path

    @classmethod
    def start(
        cls,
        model_cache_dir: Path,
        tmp: Path,
        *flags: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> Serve:
        port = port or free_port()
        log = tmp / "serve.log"
        argv = ["serve", "--port", str(port), "--cache-dir", str(model_cache_dir), *TINY, *flags]
        argv += ["--kv-store-path", str(tmp / "kv-store")]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "deepinfer", *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp), **(env or {})},
                start_new_session=True,
            )
        return cls(proc, port, log, tmp)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def children(self, part: str) -> list[psutil.Process]:
        """Live (not zombie) descendants whose command line contains ``part``."""
        found = []
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if p.status() != psutil.STATUS_ZOMBIE and part in " ".join(p.cmdline()):
                    found.append(p)
            except psutil.NoSuchProcess:
                pass
        return found

    def leftovers(self) -> list[str]:
        """Processes serve started that still run: by its session id, or by the store under tmp."""
        left = []
        for p in psutil.process_iter(["pid", "cmdline", "status"]):
            if p.pid == self.proc.pid or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                cmdline = " ".join(p.info["cmdline"] or [])
                if os.getsid(p.pid) == self.proc.pid or str(self.tmp) in cmdline:
                    left.append(f"{p.pid}: {cmdline}")
            except (ProcessLookupError, PermissionError):
                pass
        return left

    def leftovers_after(self, timeout_s: float) -> list[str]:
        """``leftovers()`` once empty, or as they are after ``timeout_s`` (grandchildren, such as
        grammar sandboxes, end when their parent's socket closes: not in the same instant)."""
        deadline = time.monotonic() + timeout_s
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def wait_until(self, what: str, ok: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"serve exited ({self.proc.returncode}) waiting for {what}:\n{self.text()[-4000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} after {timeout_s:.0f} s:\n{self.text()[-4000:]}")
            time.sleep(0.3)

    def announced_ready(self) -> bool:
        """serve's own health probe passed: it logs this once (the test's probe can pass first)."""
        return "deepinfer ready" in self.text()

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def chat(self, max_tokens: int = 8) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/chat/completions",
            json={
                "model": MODEL,
                "temperature": 0,
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            },
            timeout=60,
        )

    def answers(self) -> bool:
        """A chat completion succeeds (with some text)."""
        try:
            resp = self.chat()
        except httpx.HTTPError:
            return False
        return resp.status_code == 200 and bool(resp.json()["choices"][0]["message"]["content"])

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        for line in self.leftovers():
            with_pid = int(line.split(":", 1)[0])
            with contextlib.suppress(ProcessLookupError):
                os.kill(with_pid, 9)


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports that are free now."""
    while True:
        base = free_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return base


@contextlib.contextmanager
def serving(
    model_cache_dir: Path, tmp: Path, *flags: str, ready_s: float, env: dict[str, str] | None = None
) -> Iterator[Serve]:
    """``Serve.start`` until /health answers 200 (within ``ready_s``); killed on leaving."""
    serve = Serve.start(model_cache_dir, tmp, *flags, env=env)
    try:
        serve.wait_until("/health 200", serve.healthy, ready_s)
        yield serve
    finally:
        serve.kill()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
