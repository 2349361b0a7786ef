"""The compose file's healthchecks, run as local processes against a running local stack.

No Docker engine here: each deepinfer service's ``healthcheck.test`` runs as it would in its
container, with the service's compose environment, pointed at this stack's NATS and gateway port.
On the live stack every check passes; against an empty NATS, or a port nothing listens on, each
one fails, so a check that always passes is caught. (The nats service's check is the official
image's wget of its monitoring port: not part of this project.)
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from libs.bus.nats_server import EmbeddedNatsServer, free_port
from tests.system.stack import Stack
from tests.unit.compose.compose_file import environment, load_compose

COMPOSE_GATEWAY_PORT = "8000"
DEEPINFER_SERVICES = ("gateway", "scheduler", "worker", "kvcache")


def _run_check(service: dict[str, Any], nats_url: str, gateway_port: int) -> subprocess.CompletedProcess[str]:
    test = [str(a) for a in service["healthcheck"]["test"]]
    assert test[0] == "CMD"
    argv = test[1:]
    if argv[0] == "deepinfer":
        argv = [sys.executable, "-m", "deepinfer", *argv[1:]]
    elif argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    argv = [a.replace(f":{COMPOSE_GATEWAY_PORT}/", f":{gateway_port}/") for a in argv]
    env = {**environment(service), "DEEPINFER_NATS_URL": nats_url}
    timeout_s = float(str(service["healthcheck"].get("timeout", "5s")).rstrip("s"))
    env_path = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    return subprocess.run(
        argv, env={**env_path, **env}, capture_output=True, text=True, timeout=timeout_s + 10
    )


@pytest.mark.parametrize("name", DEEPINFER_SERVICES)
def test_healthcheck_passes_on_the_live_stack(stack: Stack, name: str) -> None:
    service = load_compose()["services"][name]
    result = _run_check(service, stack.nats.url, stack.port)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", DEEPINFER_SERVICES)
def test_healthcheck_fails_without_the_service(name: str) -> None:
    service = load_compose()["services"][name]
    with EmbeddedNatsServer() as empty:  # no member of any kind; no gateway on the port
        result = _run_check(service, empty.url, free_port())
    assert result.returncode != 0, result.stdout + result.stderr
