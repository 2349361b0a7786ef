"""Builders of the mutations the breakage tests apply to a copy of the compose file and prometheus.yml.

A ``Mutation`` edits the loaded compose file in place; a ``ScrapeMutation`` edits it and the
loaded prometheus.yml together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Mutation = Callable[[dict[str, Any]], Any]
ScrapeMutation = Callable[[dict[str, Any], dict[str, Any]], Any]  # (compose, prometheus.yml)


def set_env(service: str, key: str, value: str | None) -> Mutation:
    """Set a service's environment variable (None: remove it)."""

    def mutate(c: dict[str, Any]) -> None:
        env = c["services"][service].setdefault("environment", {})
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value

    return mutate


def set_key(service: str, key: str, value: Any) -> Mutation:
    """Set a key of a service (None: remove it)."""

    def mutate(c: dict[str, Any]) -> None:
        if value is None:
            c["services"][service].pop(key, None)
        else:
            c["services"][service][key] = value

    return mutate


def job(conf: dict[str, Any], name: str) -> dict[str, Any]:
    """The scrape job ``name`` of prometheus.yml."""
    return next(j for j in conf["scrape_configs"] if j["job_name"] == name)
