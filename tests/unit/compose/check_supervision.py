"""Checks how compose supervises each service: its restart policy, healthcheck and stop grace.

Every service restarts on exit and has a healthcheck; the gateway's grace outlasts its drain and it
stops before the services it depends on; the other deepinfer services check their own health.
"""

from __future__ import annotations

import re
from typing import Any

from tests.unit.compose.compose_file import depends_on, parse_args

RESTART_POLICIES = ("always", "unless-stopped", "on-failure")
STOP_MARGIN_S = 5.0  # stop_grace_period over the gateway's drain: its own exit, after the streams
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
_DURATION_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """A compose duration (``30s``, ``1m30s``, ``500ms``) in seconds."""
    parts = _DURATION.findall(text.strip())
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        raise ValueError(f"not a compose duration: {text!r}")
    return sum(float(n) * _DURATION_S[u] for n, u in parts)


def restart_problems(name: str, service: dict[str, Any]) -> list[str]:
    """Every service restarts on exit (a crash, or a watchdog's exit) and has a healthcheck."""
    problems = []
    if str(service.get("restart", "no")) not in RESTART_POLICIES:
        problems.append(f"{name}: restart {service.get('restart', 'no')!r}: a crashed process stays down")
    test = (service.get("healthcheck") or {}).get("test")
    if not isinstance(test, list) or len(test) < 2 or test[0] != "CMD":
        problems.append(f"{name}: no healthcheck (an exec-form CMD list)")
    return problems


def health_argv(service: dict[str, Any]) -> list[str] | None:
    """The argv after ``deepinfer`` of a ``["CMD", "deepinfer", ...]`` healthcheck, else None."""
    test = (service.get("healthcheck") or {}).get("test") or []
    return [str(a) for a in test[2:]] if test[:2] == ["CMD", "deepinfer"] else None


def supervision_problems(name: str, service: dict[str, Any], command: str, config: Any) -> list[str]:
    problems = []
    try:
        grace_s = parse_duration(str(service.get("stop_grace_period", "10s")))
    except ValueError as exc:
        return [f"{name}: stop_grace_period: {exc}"]
    if command == "gateway":
        if grace_s < config.shutdown_grace_s + STOP_MARGIN_S:
            problems.append(
                f"{name}: stop_grace_period {grace_s:.0f} s is not above shutdown_grace_s "
                f"{config.shutdown_grace_s:.0f} s + {STOP_MARGIN_S:.0f} s: the drain is cut by SIGKILL"
            )
        missing = {"scheduler", "worker"} - depends_on(service)
        if missing:
            problems.append(f"{name}: does not depend on {sorted(missing)}: it would not stop first")
    elif command in ("scheduler", "worker", "kvcache"):
        argv = health_argv(service)
        args = None if argv is None else parse_args(argv)[0]
        if args is None or args.command != "health" or args.kind != command:
            problems.append(f"{name}: healthcheck is not `deepinfer health --kind {command}`")
    return problems
