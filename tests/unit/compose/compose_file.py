"""Loading the files the compose checks read, and the small readers of one compose service.

No checks here: the paths and constants, the compose file and its monitoring configs as loaded, and
readers of one service (its environment, command, volumes, ports, dependencies, image) that the
``*_problems`` checkers build on, with compose's own ``${VAR:-default}`` interpolation.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

import yaml

from deepinfer.cli import build_parser

REPO = Path(__file__).resolve().parents[3]
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
PROMETHEUS_FILE = COMPOSE_DIR / "prometheus.yml"
GRAFANA_DIR = COMPOSE_DIR / "grafana"
DASHBOARD_FILE = GRAFANA_DIR / "deepinfer-dashboard.json"
DATASOURCES_FILE = GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS_FILE = GRAFANA_DIR / "provisioning" / "dashboards" / "deepinfer.yml"

REQUIRED_SERVICES = ("nats", "gateway", "scheduler", "worker")
NATS_DEFAULT_PORT = 4222
ANY_HOST = ("0.0.0.0", "::")
# what `pip install .` reads from the build context
BUILD_INPUTS = ("pyproject.toml", "deepinfer/cli.py", "libs/bus/nats_bus.py", "services/worker/config.py")


# ---------------------------------------------------------------- loading


def load_compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict)
    return data


def load_yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def load_dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD_FILE.read_text())
    assert isinstance(data, dict)
    return data


# ---------------------------------------------------------------- small readers


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` / ``${VAR-default}`` / ``${VAR}`` / ``$$``, checked as defaults."""
    value = re.sub(r"\$\{[A-Za-z_]\w*(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)
    return value.replace("$$", "$")


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return interpolate(str(value))


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, dict):
        return {str(k): _scalar(v) for k, v in env.items() if v is not None}
    out: dict[str, str] = {}
    for item in env:
        key, sep, value = str(item).partition("=")
        if sep:  # a bare KEY passes the host's value through: not checkable here
            out[key] = interpolate(value)
    return out


def raw_environment(service: dict[str, Any]) -> dict[str, str]:
    """The environment as written, ``${VAR:-default}`` kept: two services read one compose
    variable only if they name it alike, with the same default."""
    env = service.get("environment") or {}
    if isinstance(env, dict):
        return {
            str(k): _scalar(v) if isinstance(v, bool) else str(v) for k, v in env.items() if v is not None
        }
    return {key: value for key, sep, value in (str(item).partition("=") for item in env) if sep}


def string_list(value: Any) -> list[str] | None:
    if isinstance(value, list) and all(isinstance(v, str | int | float) for v in value):
        return [interpolate(str(v)) for v in value]
    return None


def volume_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of each volume; short ``src:dst[:mode]`` or long syntax."""
    mounts = []
    for vol in service.get("volumes") or []:
        if isinstance(vol, dict):
            mounts.append((str(vol.get("source", "")), str(vol.get("target", ""))))
        else:
            parts = interpolate(str(vol)).split(":")
            if len(parts) >= 2:
                mounts.append((parts[0], parts[1]))
            else:
                mounts.append(("", parts[0]))
    return mounts


def published_container_ports(service: dict[str, Any]) -> list[str]:
    ports = []
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            ports.append(str(entry.get("target", "")))
        else:
            ports.append(interpolate(str(entry)).rsplit(":", 1)[-1].split("/")[0])
    return ports


def depends_on(service: dict[str, Any]) -> set[str]:
    deps = service.get("depends_on") or []
    return set(deps) if isinstance(deps, list | dict) else set()


def is_nats(service: dict[str, Any]) -> bool:
    return str(service.get("image", "")).split(":")[0].split("/")[-1] == "nats"


def is_third_party(service: dict[str, Any]) -> bool:
    """An image of its own (nats, prometheus, grafana): not a deepinfer command line."""
    repository = str(service.get("image", "")).split(":")[0].split("/")[-1]
    return "build" not in service and repository != "deepinfer"


def parse_args(argv: list[str]) -> tuple[Any, str]:
    """argparse's result, or None and its error (argparse exits on a bad command line)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return build_parser().parse_args(argv), ""
    except SystemExit:
        lines = err.getvalue().strip().splitlines()
        return None, lines[-1] if lines else "argparse exited"


def flag_value(argv: list[str], *names: str) -> str | None:
    """The value of the first of ``names`` in ``argv`` (``-c FILE`` or ``--config=FILE``)."""
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None
