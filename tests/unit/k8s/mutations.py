"""Builders of the mutations the breakage tests apply to a copy of the manifests.

Each returns a ``Mutation``: a function that edits a document list in place, and fails with a
clear message if the manifests no longer hold what it edits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.unit.k8s.manifests import Doc, containers_of, require_doc

Mutation = Callable[[list[Doc]], Any]


def container_of(docs: list[Doc], component: str) -> Doc:
    """The first container of deepinfer-<component> (the nats StatefulSet, or a Deployment)."""
    kind = "StatefulSet" if component == "nats" else "Deployment"
    return containers_of(require_doc(docs, kind, f"deepinfer-{component}"))[0]


def set_env(component: str, name: str, value: str | None) -> Mutation:
    """Set a plain env value (None: remove the variable)."""

    def mutate(docs: list[Doc]) -> None:
        container = container_of(docs, component)
        env = [e for e in container.get("env") or [] if e["name"] != name]
        container["env"] = env if value is None else [*env, {"name": name, "value": value}]

    return mutate


def set_ref(component: str, name: str, secret: str, key: str) -> Mutation:
    """Set an env variable to a Secret's key."""

    def mutate(docs: list[Doc]) -> None:
        container = container_of(docs, component)
        env = [e for e in container.get("env") or [] if e["name"] != name]
        container["env"] = [*env, {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}]

    return mutate


def edit(kind: str, name: str, change: Callable[[Doc], Any]) -> Mutation:
    return lambda docs: change(require_doc(docs, kind, name))


def pod(name: str, change: Callable[[Doc], Any]) -> Mutation:
    """Edit the pod spec itself (``pod_spec`` returns a copy)."""
    kind = "StatefulSet" if name == "deepinfer-nats" else "Deployment"
    return lambda docs: change(require_doc(docs, kind, name)["spec"]["template"]["spec"])


def probe(component: str, kind: str, new: Doc | None) -> Mutation:
    """Replace a probe (None: remove it)."""

    def mutate(docs: list[Doc]) -> None:
        container = container_of(docs, component)
        if new is None:
            container.pop(kind, None)
        else:
            container[kind] = new

    return mutate


def nats_conf(old: str, new: str) -> Mutation:
    """Replace text in the ConfigMap's nats.conf."""

    def mutate(docs: list[Doc]) -> None:
        data = require_doc(docs, "ConfigMap", "deepinfer-nats-config")["data"]
        assert old in data["nats.conf"], f"nats.conf changed: no {old!r}; update this case"
        data["nats.conf"] = data["nats.conf"].replace(old, new)

    return mutate


def health_probe(kind: str) -> Doc:
    return {"exec": {"command": ["deepinfer", "health", "--kind", kind]}}
