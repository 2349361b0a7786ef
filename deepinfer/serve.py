"""``deepinfer serve``: an embedded nats-server plus worker, scheduler and gateway processes.

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
from types import FrameType

from deepinfer.runtime import setup_logging
from deepinfer.settings import add_config_args, build_config, to_argv
from libs.bus.nats_server import EmbeddedNatsServer
from services.gateway.config import Config as GatewayConfig
from services.scheduler.config import Config as SchedulerConfig
from services.worker.config import Config as WorkerConfig

log = logging.getLogger("deepinfer.serve")

READY_TIMEOUT_S = 600.0  # the first start converts the model's weights
STOP_TIMEOUT_S = 10.0


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=None, help="use this NATS instead of an embedded one")
    for cls in (GatewayConfig, WorkerConfig, SchedulerConfig):
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


def is_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200  # type: ignore[no-any-return]
    except (urllib.error.URLError, OSError):
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
    ready = False
    started = time.monotonic()
    exit_code = 0
    try:
        while not stop:
            dead = [name for name, proc in children.items() if proc.poll() is not None]
            if dead:
                log.error("%s exited (code %s): stopping the stack", dead[0], children[dead[0]].returncode)
                exit_code = 1
                break
            if not ready and is_healthy(health_url):
                ready = True
                log.info("deepinfer ready: http://%s:%d/v1 (nats %s)", gateway.host, gateway.port, nats_url)
            elif not ready and time.monotonic() - started > READY_TIMEOUT_S:
                log.error("not ready after %.0f s: stopping", READY_TIMEOUT_S)
                exit_code = 1
                break
            time.sleep(0.2)
    finally:
        _stop_all(children)
        if nats is not None:
            nats.stop()
        log.info("stopped")
    sys.exit(exit_code)
