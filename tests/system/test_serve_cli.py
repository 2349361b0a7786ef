"""``deepinfer serve``: the whole stack from one command, and nothing left behind after SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from libs.bus.nats_server import free_port
from tests.system.stack import wait_healthy


def test_serve_answers_then_sigterm_leaves_no_process(model_cache_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deepinfer",
                "serve",
                "--port",
                str(port),
                "--cache-dir",
                str(model_cache_dir),
                "--kv-cache-gb",
                "0.25",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", [proc], log, timeout_s=180)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in descendants)
        for part in ("nats-server", "deepinfer worker", "deepinfer scheduler", "deepinfer gateway"):
            assert part in names
        resp = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={
                "model": "SmolLM2-135M-Instruct",
                "temperature": 0,
                "max_tokens": 16,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            },
            timeout=60,
        )
        assert resp.status_code == 200
        assert "Paris" in resp.json()["choices"][0]["message"]["content"]  # the default dtype (bf16 here)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        _gone, alive = psutil.wait_procs(descendants, timeout=5)
        assert alive == [], f"left behind: {[p.cmdline() for p in alive]}"
        assert b"deepinfer ready" in log.read_bytes()
    finally:
        if proc.poll() is None:
            proc.kill()
            time.sleep(0.5)
