"""``deepinfer serve --num-workers 2 --num-schedulers 2``: two worker processes with ids of their
own, each supervised on its own (kill -9 of one restarts that one; the other keeps its pid), each
with its own metrics port; the two scheduler replicas drive one worker each; SIGTERM still stops
the whole stack cleanly (both workers drain and exit)."""

from __future__ import annotations

import signal
from pathlib import Path

import psutil

from tests.system.serve_proc import Serve
from tests.system.test_serve_cli import HEAL_S, READY_S, free_ports, scrape


def worker_id(proc: psutil.Process) -> str:
    argv = proc.cmdline()
    return argv[argv.index("--worker-id") + 1]


def workers(serve: Serve) -> dict[str, int]:
    """The live worker processes: pid by worker id."""
    return {worker_id(p): p.pid for p in serve.children("deepinfer worker")}


def test_two_workers_each_restarted_on_its_own(model_cache_dir: Path, tmp_path: Path) -> None:
    port = free_ports(6)  # worker, scheduler, kvcache, serve, the second worker, the second scheduler
    flags = ("--num-workers", "2", "--num-schedulers", "2", "--metrics-port", str(port))
    serve = Serve.start(model_cache_dir, tmp_path, *flags)
    try:
        serve.wait_until("/health 200", serve.healthy, READY_S)
        serve.wait_until("two workers", lambda: len(workers(serve)) == 2, 30)
        before = workers(serve)
        (first,) = [wid for wid in before if not wid.endswith("-1")]
        assert set(before) == {first, f"{first}-1"}
        assert serve.answers()
        assert ("deepinfer_worker_step_seconds_count", ()) in scrape(port + 4)  # the second's port
        serve.wait_until(
            "each replica drives one worker",
            lambda: [len(driven(port + offset)) for offset in (1, 5)] == [1, 1],
            30,
        )
        psutil.Process(before[f"{first}-1"]).kill()
        serve.wait_until(
            "the second worker restarted",
            lambda: workers(serve).keys() == {first, f"{first}-1-r1"},
            30,
        )
        assert workers(serve)[first] == before[first]  # the other one was left alone
        assert "worker-1 exited (code -9): restarting it in" in serve.text()
        assert "worker exited" not in serve.text()
        assert scrape(port + 3)[("deepinfer_restarts_total", (("service", "worker-1"),))] == 1
        serve.wait_until("an answer after the restart", serve.answers, HEAL_S)
        serve.wait_until("/health 200 again", serve.healthy, 10)
        # The restarted one is up: it serves its metrics on the second worker's port again.
        serve.wait_until("the second worker's metrics", lambda: _serves_metrics(port + 4), HEAL_S)
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(60) == 0
        text = serve.text()
        assert "did not stop in" not in text, text[-4000:]  # every worker drained and left in time
        assert "Traceback" not in text, text[-4000:]
        assert serve.leftovers_after(5) == []
    finally:
        serve.kill()


def driven(port: int) -> set[str]:
    """The workers the scheduler serving /metrics on ``port`` drives."""
    samples = scrape(port)
    return {dict(labels)["worker_id"] for name, labels in samples if name == "deepinfer_num_free_kv_blocks"}


def _serves_metrics(port: int) -> bool:
    try:
        return ("deepinfer_worker_step_seconds_count", ()) in scrape(port)
    except Exception:
        return False
