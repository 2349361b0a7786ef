"""Tests of the manifests in deploy/k8s as they are: schema-valid, listed, consistent, accepted by nats.

Every document of every file kustomization.yaml lists is validated against the API schemas of one
Kubernetes version (strict: an unknown field is an error); then the cross-reference checks must find
no problem, every service must be deployed, and nats-server itself must accept its config.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from deepinfer.cli import SERVICES
from libs.bus.nats_server import find_nats_server
from tests.unit.k8s.check_containers import service_of
from tests.unit.k8s.check_wiring import listing_problems
from tests.unit.k8s.checks import manifest_problems
from tests.unit.k8s.manifests import (
    K8S_DIR,
    K8S_VERSION,
    Doc,
    all_docs,
    container_env,
    containers_of,
    doc_name,
    kustomization_resources,
    load_manifests,
    parse_quantity,
    require_doc,
    workloads_of,
)


def _documents() -> Iterator[Any]:
    for name, doc in load_manifests():
        yield pytest.param(doc, id=f"{name}:{doc.get('kind')}/{doc_name(doc)}")


def test_kustomization_lists_every_manifest() -> None:
    assert listing_problems(kustomization_resources(), K8S_DIR) == []


@pytest.mark.parametrize("doc", list(_documents()))
def test_manifest_is_valid_kubernetes(doc: Doc) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_manifests_are_consistent() -> None:
    assert manifest_problems(all_docs()) == []


def test_every_service_is_deployed() -> None:
    commands = {
        service[0]
        for workload in workloads_of(all_docs())
        for container in containers_of(workload)
        if (service := service_of(container)) is not None
    }
    assert commands == set(SERVICES)


def test_nats_server_accepts_its_config(tmp_path: Path) -> None:
    """nats-server itself (-t: check the config and exit) reads the ConfigMap's nats.conf with the
    environment the StatefulSet gives it; without one of its variables it refuses the file."""
    docs = all_docs()
    conf = tmp_path / "nats.conf"
    conf.write_text(require_doc(docs, "ConfigMap", "deepinfer-nats-config")["data"]["nats.conf"])
    env = container_env(docs, containers_of(require_doc(docs, "StatefulSet", "deepinfer-nats"))[0])
    assert {"SERVER_NAME", "NATS_USER", "NATS_PASSWORD"} <= set(env)

    def check(environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
        argv = [find_nats_server(), "-t", "-c", str(conf)]
        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **environment}
        return subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=30)

    ok = check(env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    refused = check({k: v for k, v in env.items() if k != "NATS_PASSWORD"})
    assert refused.returncode != 0 and "NATS_PASSWORD" in refused.stdout + refused.stderr


def test_parse_quantity() -> None:
    assert parse_quantity("100Gi") == 100 * 1024**3
    assert parse_quantity("500M") == 5e8
    assert parse_quantity("2") == 2
    with pytest.raises(ValueError):
        parse_quantity("100GB")
