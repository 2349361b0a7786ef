"""``deepinfer serve``: an embedded nats-server plus worker, scheduler, kvcache and gateway processes.

A plain supervisor (no event loop): start everything, wait for the gateway's /health, then watch.
SIGINT/SIGTERM or any child's death stops every process it started, nats-server last. Children
also get SIGKILL from the kernel if this process dies without cleaning up (Linux).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from types import FrameType

from deepinfer.runtime import setup_logging
from deepinfer.settings import add_config_args, build_config, to_argv
from libs.bus.nats_server import EmbeddedNatsServer
from services.gateway.config import Config as GatewayConfig
from services.kvcache.config import Config as KVCacheConfig
from services.scheduler.config import Config as SchedulerConfig
from services.worker.config import Config as WorkerConfig

log = logging.getLogger("deepinfer.serve")

READY_TIMEOUT_S = 600.0  # the first start converts the model's weights
STOP_TIMEOUT_S = 10.0


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=None, help="use this NATS instead of an embedded one")
    # A field two services share (nats_url, cache_dir, kv_store_path, ...) is one flag for both.
    for cls in (GatewayConfig, WorkerConfig, SchedulerConfig, KVCacheConfig):
        add_config_args(parser, cls)


def _die_with_parent() -> None:
    """In the child before exec: ask the kernel for SIGKILL when the parent goes away."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: a clean stop still ends every child


def _spawn(command: str, argv: list[str]) -> subprocess.Popen[bytes]:
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    return subprocess.Popen([sys.executable, "-m", "deepinfer", command, *argv], preexec_fn=preexec)


class ChildExited(RuntimeError):
    """A process that should be running has exited."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        super().__init__(f"{proc.args!r} exited with {proc.returncode}")
        self.proc = proc


def check_alive(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """Raises ChildExited for the first of ``procs`` that has exited."""
    for proc in procs:
        if proc.poll() is not None:
            raise ChildExited(proc)


def is_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200  # type: ignore[no-any-return]
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(
    url: str,
    procs: Iterable[subprocess.Popen[bytes]],
    timeout_s: float,
    interval_s: float = 0.1,
    stopped: Callable[[], bool] = lambda: False,
) -> bool:
    """Poll ``url`` until it answers 200 (True), or until ``stopped()`` (False).

    Raises ChildExited if one of ``procs`` (those that serve it) exits first, TimeoutError after
    ``timeout_s``.
    """
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    while not stopped():
        check_alive(procs)
        if is_healthy(url):
            return True
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")
        time.sleep(interval_s)
    return False


def _stop_all(children: dict[str, subprocess.Popen[bytes]]) -> None:
    for proc in children.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for name, proc in children.items():
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in time: killing it", name)
            proc.kill()
            proc.wait()


def main(args: argparse.Namespace) -> None:
    gateway = build_config(GatewayConfig, args, os.environ)
    setup_logging(gateway.log_level, "serve")
    nats: EmbeddedNatsServer | None = None
    nats_url = args.nats_url or os.environ.get("DEEPINFER_NATS_URL", "")
    if not nats_url:
        nats = EmbeddedNatsServer()
        nats.start()
        nats_url = nats.url
    configs = {
        "worker": dataclasses.replace(build_config(WorkerConfig, args, os.environ), nats_url=nats_url),
        "scheduler": dataclasses.replace(build_config(SchedulerConfig, args, os.environ), nats_url=nats_url),
        "kvcache": dataclasses.replace(build_config(KVCacheConfig, args, os.environ), nats_url=nats_url),
        "gateway": dataclasses.replace(gateway, nats_url=nats_url),
    }
    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    children = {name: _spawn(name, to_argv(config)) for name, config in configs.items()}
    health_url = f"http://{gateway.host}:{gateway.port}/health"
    exit_code = 0
    try:
        if wait_healthy(health_url, children.values(), READY_TIMEOUT_S, 0.2, lambda: stop):
            log.info("deepinfer ready: http://%s:%d/v1 (nats %s)", gateway.host, gateway.port, nats_url)
        while not stop:
            check_alive(children.values())
            time.sleep(0.2)
    except ChildExited as exc:
        name = next(name for name, proc in children.items() if proc is exc.proc)
        log.error("%s exited (code %s): stopping the stack", name, exc.proc.returncode)
        exit_code = 1
    except TimeoutError:
        log.error("not ready after %.0f s: stopping", READY_TIMEOUT_S)
        exit_code = 1
    finally:
        _stop_all(children)
        if nats is not None:
            nats.stop()
        log.info("stopped")
    sys.exit(exit_code)
