"""Breakage tests: deliberately broken copies of the manifests must each be caught by a checker.

Every case of ``MANIFEST_BREAKAGES`` mutates a deep copy of the real documents and names a problem
that ``manifest_problems`` must then report; the listing and schema checks get their own broken inputs.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests.unit.k8s.check_wiring import listing_problems
from tests.unit.k8s.checks import manifest_problems
from tests.unit.k8s.manifests import GPU_RESOURCE, K8S_VERSION, all_docs, require_doc
from tests.unit.k8s.mutations import (
    Mutation,
    container_of,
    edit,
    health_probe,
    nats_conf,
    pod,
    probe,
    set_env,
    set_ref,
)

MANIFEST_BREAKAGES: dict[str, tuple[Mutation, str]] = {
    # Config fields and values
    "unknown env": (set_env("scheduler", "DEEPINFER_PORT", "9000"), "not a field of the scheduler Config"),
    "env typo": (set_env("worker", "DEEPINFER_KV_STORE_PTH", "/kv-store"), "DEEPINFER_KV_STORE_PTH"),
    "bad value": (set_env("worker", "DEEPINFER_KV_CACHE_GB", "0"), "kv_cache_gb"),
    "bad int": (set_env("gateway", "DEEPINFER_PORT", "eighty"), "DEEPINFER_PORT"),
    "wrong subcommand": (
        lambda d: container_of(d, "kvcache").__setitem__("args", ["kvcach"]),
        "are not `deepinfer <service>`",
    ),
    "entrypoint replaced": (
        lambda d: container_of(d, "scheduler").__setitem__("command", ["python"]),
        "are not `deepinfer <service>`",
    ),
    # NATS: the URL and the login
    "nats host": (set_env("worker", "DEEPINFER_NATS_URL", "nats://nats:4222"), "nats_url"),
    "nats port": (set_env("gateway", "DEEPINFER_NATS_URL", "nats://deepinfer-nats:6222"), "nats_url"),
    "nats default url": (set_env("kvcache", "DEEPINFER_NATS_URL", None), "nats_url"),
    "no nats user": (set_env("scheduler", "DEEPINFER_NATS_USER", None), "DEEPINFER_NATS_USER is not"),
    "literal nats password": (
        set_env("gateway", "DEEPINFER_NATS_PASSWORD", "change-me"),
        "DEEPINFER_NATS_PASSWORD is not",
    ),
    "password from another key": (
        set_ref("worker", "DEEPINFER_NATS_PASSWORD", "deepinfer-nats-auth", "user"),
        "DEEPINFER_NATS_PASSWORD is not",
    ),
    "missing secret": (
        set_ref("worker", "DEEPINFER_NATS_PASSWORD", "nats-auth", "password"),
        "no Secret 'nats-auth'",
    ),
    "missing secret key": (
        set_ref("kvcache", "DEEPINFER_NATS_USER", "deepinfer-nats-auth", "username"),
        "with key 'username'",
    ),
    # volumes and claims
    "missing claim": (
        pod("deepinfer-worker", lambda s: s["volumes"][1]["persistentVolumeClaim"].update(claimName="kv")),
        "no PersistentVolumeClaim 'kv'",
    ),
    "missing configmap": (
        pod("deepinfer-nats", lambda s: s["volumes"][0]["configMap"].update(name="nats-config")),
        "no ConfigMap 'nats-config'",
    ),
    "missing configmap key": (
        pod("deepinfer-nats", lambda s: s["volumes"][0]["configMap"]["items"][0].update(key="nats.cfg")),
        "has no key 'nats.cfg'",
    ),
    "mount of no volume": (
        lambda d: container_of(d, "worker")["volumeMounts"][0].update(name="cache"),
        "no such volume",
    ),
    "kv store not mounted": (
        set_env("kvcache", "DEEPINFER_KV_STORE_PATH", "/store"),
        "not on a shared claim",
    ),
    "kv store on the model cache": (
        set_env("worker", "DEEPINFER_KV_STORE_PATH", "/cache/kv-store"),
        "the KV store is on different claims",
    ),
    "kv store off": (set_env("worker", "DEEPINFER_KV_STORE_PATH", "none"), "not on a shared claim"),
    "cache not on a claim": (set_env("worker", "DEEPINFER_CACHE_DIR", "/tmp/cache"), "not on a claim"),
    "store bigger than its claim": (
        set_env("kvcache", "DEEPINFER_STORE_CAPACITY_GB", "500"),
        "above the claim's",
    ),
    "shared claim on one node": (
        edit(
            "PersistentVolumeClaim",
            "deepinfer-kv-store",
            lambda c: c["spec"].update(accessModes=["ReadWriteOnce"]),
        ),
        "pods on several nodes mount it",
    ),
    "root user": (
        pod("deepinfer-worker", lambda s: s["securityContext"].update(runAsUser=0)),
        "runAsUser 0",
    ),
    "no fsGroup": (pod("deepinfer-kvcache", lambda s: s["securityContext"].pop("fsGroup")), "fsGroup None"),
    # labels and selectors
    "service selects nothing": (
        edit(
            "Service",
            "deepinfer-gateway",
            lambda s: s["spec"]["selector"].update({"app.kubernetes.io/component": "gw"}),
        ),
        "matches no pods",
    ),
    "service target port": (
        edit("Service", "deepinfer-gateway", lambda s: s["spec"]["ports"][0].update(targetPort="web")),
        "targets web",
    ),
    "selector off its pods": (
        edit(
            "Deployment",
            "deepinfer-scheduler",
            lambda w: w["spec"]["template"]["metadata"]["labels"].update(
                {"app.kubernetes.io/component": "sched"}
            ),
        ),
        "does not match its pod labels",
    ),
    "overlapping selectors": (
        edit(
            "Deployment",
            "deepinfer-worker",
            lambda w: w["spec"]["selector"]["matchLabels"].pop("app.kubernetes.io/component"),
        ),
        "also matches the pods of",
    ),
    "not headless": (
        edit("Service", "deepinfer-nats-headless", lambda s: s["spec"].pop("clusterIP")),
        "is not headless",
    ),
    "statefulset service": (
        edit("StatefulSet", "deepinfer-nats", lambda w: w["spec"].update(serviceName="nats")),
        "serviceName 'nats'",
    ),
    "anti-affinity off": (
        pod(
            "deepinfer-nats",
            lambda s: s["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0][
                "podAffinityTerm"
            ]["labelSelector"]["matchLabels"].update({"app.kubernetes.io/component": "nat"}),
        ),
        "anti-affinity selector",
    ),
    # probes
    "gateway liveness on readiness": (
        probe("gateway", "livenessProbe", {"httpGet": {"path": "/readyz", "port": "http"}}),
        "livenessProbe is not an HTTP GET of /livez",
    ),
    "gateway probe port": (
        probe("gateway", "readinessProbe", {"httpGet": {"path": "/readyz", "port": 8080}}),
        "is not the port the gateway listens on",
    ),
    "gateway probe route": (
        probe("gateway", "startupProbe", {"httpGet": {"path": "/healthz", "port": "http"}}),
        "not a gateway route",
    ),
    "health of another kind": (
        probe("kvcache", "livenessProbe", health_probe("worker")),
        "checks kind 'worker'",
    ),
    "health kind that is not": (
        probe("scheduler", "readinessProbe", health_probe("schedular")),
        "checks kind 'schedular', not 'scheduler'",
    ),
    "probe not health": (
        probe("worker", "startupProbe", {"exec": {"command": ["deepinfer", "worker"]}}),
        "not an exec of `deepinfer health",
    ),
    "no liveness": (probe("worker", "livenessProbe", None), "no liveness and readiness probes"),
    "health without the login": (
        set_env("scheduler", "DEEPINFER_NATS_TIMEOUT_S", "3"),
        "`deepinfer health` does not read DEEPINFER_NATS_TIMEOUT_S",
    ),
    # services
    "gateway loopback": (set_env("gateway", "DEEPINFER_HOST", None), "listens on 127.0.0.1"),
    "gateway port": (set_env("gateway", "DEEPINFER_PORT", "9000"), "listens on 9000"),
    "gateway drain cut": (
        pod("deepinfer-gateway", lambda s: s.update(terminationGracePeriodSeconds=20)),
        "the drain is cut by SIGKILL",
    ),
    "no keys file": (set_env("gateway", "DEEPINFER_API_KEYS_FILE", None), "no api_keys_file"),
    "keys file not in the secret": (
        set_env("gateway", "DEEPINFER_API_KEYS_FILE", "/etc/deepinfer/api-keys/keys.yaml"),
        "has no key 'keys.yaml'",
    ),
    "keys file unparsable": (
        edit("Secret", "deepinfer-api-keys", lambda s: s["stringData"].update({"keys.json": '{"key": []}'})),
        "must be an object",
    ),
    "one scheduler": (
        edit("Deployment", "deepinfer-scheduler", lambda w: w["spec"].update(replicas=1)),
        "replicas",
    ),
    "fixed worker id": (set_env("worker", "DEEPINFER_WORKER_ID", "w1"), "fixed worker id"),
    "no gpu": (
        lambda d: container_of(d, "worker")["resources"]["limits"].pop(GPU_RESOURCE),
        "does not ask for nvidia.com/gpu",
    ),
    "worker on cpu": (set_env("worker", "DEEPINFER_DEVICE", "cpu"), "device 'cpu' on a GPU pod"),
    "worker drain cut": (
        pod("deepinfer-worker", lambda s: s.update(terminationGracePeriodSeconds=30)),
        "drain_timeout_s",
    ),
    # nats
    "two servers": (
        edit("StatefulSet", "deepinfer-nats", lambda w: w["spec"].update(replicas=2)),
        "odd number",
    ),
    "missing route": (
        nats_conf("nats://deepinfer-nats-2.deepinfer-nats-headless:6222\n", ""),
        "are not every server",
    ),
    "route to the client port": (
        nats_conf("nats-0.deepinfer-nats-headless:6222", "nats-0.deepinfer-nats-headless:4222"),
        "are not every server",
    ),
    "small payload": (nats_conf("max_payload: 8MB", "max_payload: 1MB"), "max_payload 1MB"),
    "store off the claim": (
        nats_conf("store_dir: /data/jetstream", "store_dir: /tmp/js"),
        "not on a volumeClaimTemplate",
    ),
    "fixed server name": (nats_conf("server_name: $SERVER_NAME", "server_name: nats"), "server_name 'nats'"),
    "no authorization": (nats_conf("authorization {", "no_authorization {"), "no authorization block"),
    "literal password": (
        nats_conf("password: $NATS_PASSWORD", "password: secret"),
        "authorization password 'secret'",
    ),
    "nats client port": (nats_conf("port: 4222\n", "port: 4223\n"), "client port 4223"),
    # the autoscaler
    "hpa metric": (
        edit(
            "HorizontalPodAutoscaler",
            "deepinfer-gateway",
            lambda h: h["spec"]["metrics"][0]["pods"]["metric"].update(name="requests_in_flight"),
        ),
        "'requests_in_flight' is not a Pods metric",
    ),
    "hpa target": (
        edit(
            "HorizontalPodAutoscaler",
            "deepinfer-gateway",
            lambda h: h["spec"]["scaleTargetRef"].update(name="deepinfer-worker"),
        ),
        "does not scale the gateway",
    ),
    "hpa of nothing": (
        edit(
            "HorizontalPodAutoscaler",
            "deepinfer-gateway",
            lambda h: h["spec"]["scaleTargetRef"].update(name="gateway"),
        ),
        "no Deployment/gateway",
    ),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_BREAKAGES))
def test_manifest_checker_catches(case: str) -> None:
    docs = copy.deepcopy(all_docs())
    mutate, expected = MANIFEST_BREAKAGES[case]
    mutate(docs)
    problems = manifest_problems(docs)
    assert any(expected in p for p in problems), problems


def test_listing_checker_catches(tmp_path: Path) -> None:
    for name in ("a.yaml", "b.yaml", "c.yml"):
        (tmp_path / name).write_text("{}\n")
    problems = listing_problems(["a.yaml", "a.yaml", "b.yaml", "gone.yaml"], tmp_path)
    assert problems == [
        "a.yaml: listed twice",
        "gone.yaml: listed but missing",
        "c.yml: not listed in kustomization.yaml",
    ]


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "template", "spec", "containers", 0, "imagePullPolicyy"), "Always"),  # a misspelled field
        (("spec", "replicas"), "two"),
        (("spec", "template", "spec", "containers", 0, "ports", 0, "containerPort"), "8000"),
    ],
)
def test_schema_validation_catches(path: tuple[Any, ...], value: Any) -> None:
    broken = copy.deepcopy(require_doc(all_docs(), "Deployment", "deepinfer-gateway"))
    node: Any = broken
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
