"""``deepinfer serve``: the whole stack from one command; it heals itself, stops cleanly and leaves
nothing behind. Real processes, real faults (kill -9 by pid, Ctrl-C to the process group)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.service.test_nats_auth import refused
from tests.system.serve_proc import MODEL, Serve, free_ports, scrape, serving

READY_S = 240.0
NATS_USER, NATS_PASSWORD = "deepinfer", "not-in-any-argv"
HEAL_S = 180.0  # a restarted worker loads the model again, on a loaded machine


def _listen_ports(proc: psutil.Process) -> set[int]:
    return {c.laddr.port for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def test_bad_config_exits_2_and_starts_nothing(model_cache_dir: Path, tmp_path: Path) -> None:
    serve = Serve.start(model_cache_dir, tmp_path, "--max-num-seqs", "-1")
    try:
        assert serve.proc.wait(60) == 2
        assert "max_num_seqs must be > 0" in serve.text()
        assert serve.leftovers_after(5) == []  # before: an orphan nats-server (PPID 1) kept running
    finally:
        serve.kill()


def test_sigterm_drains_streams_then_leaves_no_process(model_cache_dir: Path, tmp_path: Path) -> None:
    serve = Serve.start(model_cache_dir, tmp_path, "--shutdown-grace-s", "30")
    try:
        serve.wait_until("/health 200", serve.healthy, READY_S)
        serve.wait_until("'deepinfer ready' in the log", serve.announced_ready, READY_S)
        names = " ".join(
            " ".join(p.cmdline()) for p in psutil.Process(serve.proc.pid).children(recursive=True)
        )
        for part in ("nats-server", "deepinfer worker", "deepinfer scheduler", "deepinfer gateway"):
            assert part in names
        started = threading.Event()
        events: list[dict] = []  # type: ignore[type-arg]

        def stream() -> None:
            body = {"model": MODEL, "temperature": 0, "max_tokens": 48, "stream": True}
            body["messages"] = [{"role": "user", "content": "Tell me about Paris."}]
            with httpx.stream("POST", f"{serve.url}/v1/chat/completions", json=body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(120), serve.text()[-4000:]
        serve.proc.send_signal(signal.SIGTERM)  # mid-stream
        reader.join(120)
        assert serve.proc.wait(60) == 0
        # The stream in flight ran to its end: the gateway drained before anything stopped.
        finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
        assert finish in (["length"], ["stop"]), events[-3:]
        assert serve.leftovers_after(5) == []
        assert "Traceback" not in serve.text(), serve.text()[-4000:]
    finally:
        serve.kill()


def test_restart_limit_stops_the_stack_with_exit_1(model_cache_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:  # the gateway cannot bind its port: it exits, again and again
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        serve = Serve.start(model_cache_dir, tmp_path, "--max-restarts", "1", port=port)
        try:
            assert serve.proc.wait(240) == 1, serve.text()[-4000:]
        finally:
            serve.kill()
    text = serve.text()
    assert "gateway exited (code" in text and "restarting it in" in text
    assert "after 1 restarts within 60 s: giving up: stopping the stack" in text
    assert serve.leftovers_after(5) == []


@pytest.fixture(scope="module")
def metrics_port() -> int:
    """The first of serve's metrics ports: worker, scheduler, kvcache, then serve's own. Taken when
    the stack starts, not at import: a port free then may be any process's by the time it runs."""
    return free_ports(4)


@pytest.fixture(scope="module")
def running(
    model_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory, metrics_port: int
) -> Iterator[Serve]:
    """One stack for the fault tests below, which run in order; the last one stops it. Its NATS
    requires a user and password (the password in the environment, as the README advises)."""
    tmp = tmp_path_factory.mktemp("serve")
    flags = ("--metrics-port", str(metrics_port), "--nats-user", NATS_USER)
    env = {"DEEPINFER_NATS_PASSWORD": NATS_PASSWORD}
    with serving(model_cache_dir, tmp, *flags, ready_s=READY_S, env=env) as serve:
        yield serve


def test_nats_requires_the_credentials_and_no_argv_shows_the_password(running: Serve) -> None:
    (nats_proc,) = running.children("nats-server")
    (port,) = _listen_ports(nats_proc)  # the client port (the embedded server has no monitor port)
    url = f"nats://127.0.0.1:{port}"
    assert asyncio.run(refused(url))
    assert asyncio.run(refused(url, user=NATS_USER, password="wrong"))
    assert not asyncio.run(refused(url, user=NATS_USER, password=NATS_PASSWORD))
    for child in psutil.Process(running.proc.pid).children(recursive=True):
        assert NATS_PASSWORD not in " ".join(child.cmdline())


def test_kill_9_worker_is_restarted_and_serves(running: Serve, metrics_port: int) -> None:
    assert running.answers()
    (worker,) = running.children("deepinfer worker")
    worker.kill()
    running.wait_until(
        "a new worker",
        lambda: [p.pid for p in running.children("deepinfer worker")] not in ([], [worker.pid]),
        30,
    )
    assert "worker exited (code -9): restarting it in" in running.text()
    running.wait_until("an answer from the restarted worker", running.answers, HEAL_S)
    # The gateway confirms the new worker from two reads of the members a second apart, and the
    # scheduler may hand it work before that: /health follows within a few seconds.
    running.wait_until("/health 200 again", running.healthy, 5)
    # Each service on its own port, serve's restart counter after them.
    assert scrape(metrics_port + 3)[("deepinfer_restarts_total", (("service", "worker"),))] == 1
    assert scrape(metrics_port)[("deepinfer_worker_step_seconds_count", ())] > 0  # the new worker's
    assert ("deepinfer_steps_total", ()) in scrape(metrics_port + 1)


def test_kill_9_nats_server_is_restarted_on_its_port(running: Serve) -> None:
    (nats,) = running.children("nats-server")
    ports = _listen_ports(nats)
    nats.kill()
    running.wait_until(
        "a new nats-server",
        lambda: [p.pid for p in running.children("nats-server")] not in ([], [nats.pid]),
        30,
    )
    assert not psutil.pid_exists(nats.pid)  # reaped: no <defunct> left
    (again,) = running.children("nats-server")
    running.wait_until("nats listening", lambda: _listen_ports(again) >= ports, 30)
    assert "nats-server exited (code -9): restarting it in" in running.text()
    # The services reconnect to the same URL (their NATS client retries forever).
    running.wait_until("an answer after the nats restart", running.answers, HEAL_S)


def test_sighup_goes_to_the_gateway_and_stops_nothing(running: Serve) -> None:
    """SIGHUP to serve: the gateway reloads its keys (none here, it says so); nothing stops."""
    children = {p.pid for p in psutil.Process(running.proc.pid).children()}
    running.proc.send_signal(signal.SIGHUP)
    said = "SIGHUP: no --api-keys-file"
    running.wait_until("the gateway's SIGHUP line", lambda: said in running.text(), 10)
    assert running.proc.poll() is None and running.answers()
    assert {p.pid for p in psutil.Process(running.proc.pid).children()} == children


def test_ctrl_c_stops_quietly_within_5_s(running: Serve) -> None:
    children = psutil.Process(running.proc.pid).children()  # the services and nats-server
    descendants = psutil.Process(running.proc.pid).children(recursive=True)
    mark = len(running.text())
    os.killpg(running.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    assert running.proc.wait(5) == 0
    _gone, alive = psutil.wait_procs(children, timeout=0)  # serve reaped each before it exited
    assert alive == [], f"left behind: {[p.cmdline() for p in alive]}"
    # Grandchildren (grammar sandboxes) end when their parent's socket closes, a moment later.
    _gone, alive = psutil.wait_procs(descendants, timeout=10)
    assert alive == [], f"left behind: {[p.cmdline() for p in alive]}"
    assert running.leftovers_after(10) == []
    after = running.text()[mark:]
    assert "Traceback" not in after and "KeyboardInterrupt" not in after, after[-4000:]
    # nats-server stopped last: no service saw it go away while it was still running
    assert "Connection refused" not in after and "ConnectionRefused" not in after, after[-4000:]
