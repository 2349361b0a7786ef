"""Checks each deepinfer container against the code: its command, env, volumes, user and probes.

Its ``DEEPINFER_*`` variables are fields of its service's Config and build a valid one; it reaches
NATS through the Service with the servers' login; its paths are on the right volumes; its probes
are its own health; the service's own needs (ports, replicas, a GPU, drain time) are met.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import urlsplit

from deepinfer import health
from deepinfer.cli import SERVICES
from libs.runtime.settings import ENV_PREFIX, build_config
from services.gateway.api_keys import parse_keys
from tests.unit.compose.check_supervision import STOP_MARGIN_S
from tests.unit.compose.compose_file import ANY_HOST
from tests.unit.k8s.check_nats import NatsFacts
from tests.unit.k8s.manifests import (
    DEEPINFER_IMAGE,
    GPU_RESOURCE,
    MIN_SCHEDULERS,
    NATS_CLIENT_PORT,
    NATS_CREDENTIALS,
    Doc,
    container_env,
    container_ports,
    containers_of,
    doc_name,
    env_source,
    find_doc,
    gateway_routes,
    image_name,
    mount_of,
    mounted_key,
    parse_cli,
    parse_quantity,
    pod_labels,
    pod_spec,
    secret_values,
    selects,
    workloads_of,
)

_PROBE_KINDS = ("startupProbe", "livenessProbe", "readinessProbe")


@dataclasses.dataclass(frozen=True)
class ServiceContainer:
    """One deepinfer container whose Config was built: where it runs and what it runs."""

    docs: list[Doc]
    where: str
    workload: Doc
    container: Doc
    command: str
    args: Any
    config: Any
    env: dict[str, str]
    env_names: list[str]
    fields: set[str]

    @property
    def grace(self) -> int:
        return int(pod_spec(self.workload).get("terminationGracePeriodSeconds", 30))


def service_of(container: Doc) -> tuple[str, Any] | None:
    """The deepinfer subcommand the container runs (the image's ENTRYPOINT is ``deepinfer``)."""
    if container.get("command") not in (None, ["deepinfer"]):
        return None
    args = parse_cli([str(a) for a in container.get("args") or []])
    if args is None or args.command not in SERVICES:
        return None
    return args.command, args


def container_problems(docs: list[Doc], nats: NatsFacts, image_uid: str) -> list[str]:
    """Each deepinfer container: a service whose ``DEEPINFER_*`` variables are its Config fields and
    build a valid Config; NATS reached by its Service, logged in with the nats servers' Secret; its
    paths on the right volumes; probes on its health; the image's user owning its volumes."""
    problems = []
    kv_claims: dict[str, str] = {}
    for workload in workloads_of(docs):
        for container in containers_of(workload):
            if image_name(container) != DEEPINFER_IMAGE:
                continue
            where = f"{workload['kind']}/{doc_name(workload)}: {container.get('name')}"
            found, service = _build_service(docs, where, workload, container, nats)
            problems += found
            if service is None:
                continue
            problems += _user_problems(service, image_uid)
            problems += _nats_url_problems(service, nats)
            problems += _cache_problems(service)
            found, claim = _kv_store_problems(service)
            problems += found
            if claim is not None:
                kv_claims[where] = claim
            problems += _gateway_problems(service) + _scheduler_problems(service) + _worker_problems(service)
            problems += probe_problems(service)
    if len(set(kv_claims.values())) > 1:
        problems.append(f"the KV store is on different claims: {kv_claims}")
    return problems


def _build_service(
    docs: list[Doc], where: str, workload: Doc, container: Doc, nats: NatsFacts
) -> tuple[list[str], ServiceContainer | None]:
    """The container's command, env names and NATS login, and its Config (None if it has none)."""
    found = service_of(container)
    if found is None:
        return [f"{where}: args {container.get('args')} are not `deepinfer <service>`"], None
    command, args = found
    config_cls = SERVICES[command][1]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    names = [str(e["name"]) for e in container.get("env") or []]
    problems = [
        f"{where}: {key} is not a field of the {command} Config"
        for key in names
        if key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX) :].lower() not in fields
    ]
    for field_name, env_name in NATS_CREDENTIALS.items():
        ref = (env_source(container, env_name) or {}).get("secretKeyRef")
        wanted = nats.credentials.get(field_name)
        if ref is None or wanted is None or dict(ref) != wanted:
            problems.append(f"{where}: {env_name} is not the nats servers' Secret key {wanted}")
    env = container_env(docs, container)
    try:
        config: Any = build_config(config_cls, args, {k: v for k, v in env.items() if k in names})
    except (ValueError, TypeError) as exc:
        return [*problems, f"{where}: bad configuration: {exc}"], None
    service = ServiceContainer(docs, where, workload, container, command, args, config, env, names, fields)
    return problems, service


def _user_problems(s: ServiceContainer, image_uid: str) -> list[str]:
    pod_security = pod_spec(s.workload).get("securityContext") or {}
    user = (s.container.get("securityContext") or {}).get("runAsUser", pod_security.get("runAsUser"))
    if str(user) != image_uid or str(pod_security.get("fsGroup")) != image_uid:
        return [
            f"{s.where}: runAsUser {user} / fsGroup {pod_security.get('fsGroup')} are not the image's "
            f"uid {image_uid}: its volumes would not be writable"
        ]
    return []


def _nats_url_problems(s: ServiceContainer, nats: NatsFacts) -> list[str]:
    """The nats_url is a Service selecting the nats pods, on a port to their client port."""
    url = urlsplit(s.config.nats_url)
    nats_service = find_doc(s.docs, "Service", str(url.hostname))
    service_ports = {
        int(p["port"]): str(p.get("targetPort", p["port"]))
        for p in ((nats_service or {}).get("spec") or {}).get("ports") or []
    }
    nats_sts = next((w for w in workloads_of(s.docs) if pod_labels(w) == nats.labels), None)
    target = service_ports.get(url.port or NATS_CLIENT_PORT)
    if (
        url.scheme != "nats"
        or nats_service is None
        or nats_sts is None
        or not selects((nats_service.get("spec") or {}).get("selector") or {}, nats.labels)
        or container_ports(nats_sts).get(str(target)) != nats.client_port
    ):
        return [f"{s.where}: nats_url {s.config.nats_url} is not a Service to the nats client port"]
    return []


def _cache_problems(s: ServiceContainer) -> list[str]:
    if "cache_dir" in s.fields and s.config.cache_dir:
        on = mount_of(s.workload, s.container, s.config.cache_dir)
        if on is None or "persistentVolumeClaim" not in on[1]:
            return [f"{s.where}: cache dir {s.config.cache_dir} is not on a claim"]
    return []


def _kv_store_problems(s: ServiceContainer) -> tuple[list[str], str | None]:
    """The KV store on a claim big enough for its capacity, and that claim's name."""
    if "kv_store_path" not in s.fields:
        return [], None
    path = s.config.kv_store_path
    on = mount_of(s.workload, s.container, path) if path else None
    claim = None if on is None else (on[1].get("persistentVolumeClaim") or {}).get("claimName")
    if claim is None:
        return [f"{s.where}: kv store {path!r} is not on a shared claim"], None
    claim_doc = find_doc(s.docs, "PersistentVolumeClaim", str(claim))
    size = (((claim_doc or {}).get("spec") or {}).get("resources") or {}).get("requests", {})
    capacity = getattr(s.config, "store_capacity_gb", 0.0) * 1024**3
    if "storage" in size and capacity > parse_quantity(str(size["storage"])):
        return [
            f"{s.where}: store_capacity_gb {s.config.store_capacity_gb} is above the "
            f"claim's {size['storage']}"
        ], str(claim)
    return [], str(claim)


def _gateway_problems(s: ServiceContainer) -> list[str]:
    """The gateway listens on a containerPort of all addresses, drains before SIGKILL, has keys."""
    if s.command != "gateway":
        return []
    problems = []
    if s.config.host not in ANY_HOST:
        problems.append(f"{s.where}: listens on {s.config.host}, unreachable from outside the pod")
    if str(s.config.port) not in container_ports(s.workload):
        problems.append(f"{s.where}: listens on {s.config.port}, not a containerPort")
    if s.grace < s.config.shutdown_grace_s + STOP_MARGIN_S:
        problems.append(
            f"{s.where}: terminationGracePeriodSeconds {s.grace} is not above shutdown_grace_s "
            f"{s.config.shutdown_grace_s:.0f} + {STOP_MARGIN_S:.0f}: the drain is cut by SIGKILL"
        )
    return problems + _keys_file_problems(s, s.config.api_keys_file)


def _keys_file_problems(s: ServiceContainer, path: str) -> list[str]:
    """The gateway's API keys file: a key of a mounted Secret, holding a keys file it can parse."""
    if not path:
        return [f"{s.where}: no api_keys_file: anyone who reaches the Service may call it"]
    on = mount_of(s.workload, s.container, path)
    if on is None or "secret" not in on[1]:
        return [f"{s.where}: api_keys_file {path} is not in a mounted Secret"]
    mount, volume = on
    key = mounted_key(path, mount, volume["secret"])
    secret = find_doc(s.docs, "Secret", str(volume["secret"].get("secretName")))
    text = None if secret is None else secret_values(secret).get(key)
    if text is None:
        return [f"{s.where}: api_keys_file {path}: the Secret has no key {key!r}"]
    try:
        parse_keys(text, f"{s.where}: api_keys_file")
    except ValueError as exc:
        return [str(exc)]
    return []


def _scheduler_problems(s: ServiceContainer) -> list[str]:
    if s.command == "scheduler" and int((s.workload.get("spec") or {}).get("replicas", 1)) < MIN_SCHEDULERS:
        return [f"{s.where}: fewer than {MIN_SCHEDULERS} replicas: a lost scheduler's requests fail"]
    return []


def _worker_problems(s: ServiceContainer) -> list[str]:
    """A worker: no fixed id, one GPU and a CUDA device, time to drain before SIGKILL."""
    if s.command != "worker":
        return []
    problems = []
    if f"{ENV_PREFIX}WORKER_ID" in s.env_names or s.args.worker_id is not None:
        problems.append(f"{s.where}: a fixed worker id makes the replicas collide")
    resources = s.container.get("resources") or {}
    gpus = {str((resources.get(k) or {}).get(GPU_RESOURCE)) for k in ("requests", "limits")}
    if gpus != {"1"}:
        problems.append(f"{s.where}: does not ask for {GPU_RESOURCE}: 1 (requests = limits)")
    if not s.config.device.startswith("cuda"):
        problems.append(f"{s.where}: device {s.config.device!r} on a GPU pod")
    if s.grace < s.config.drain_timeout_s + STOP_MARGIN_S:
        problems.append(
            f"{s.where}: terminationGracePeriodSeconds {s.grace} is not above drain_timeout_s "
            f"{s.config.drain_timeout_s:.0f} + {STOP_MARGIN_S:.0f}: the drain is cut by SIGKILL"
        )
    return problems


# ---------------------------------------------------------------- probes


def probe_problems(s: ServiceContainer) -> list[str]:
    """The gateway's probes are GETs of its routes; every other service's are its own health."""
    probes = {kind: s.container.get(kind) for kind in _PROBE_KINDS}
    if s.command == "gateway":
        return _http_probe_problems(s, probes)
    problems = []
    if probes["livenessProbe"] is None or probes["readinessProbe"] is None:
        problems.append(f"{s.where}: no liveness and readiness probes")
    for kind, probe in probes.items():
        if probe is not None:
            problems += _health_probe_problems(s, kind, probe)
    return problems


def _http_probe_problems(s: ServiceContainer, probes: dict[str, Doc | None]) -> list[str]:
    problems = []
    ports = container_ports(s.workload)
    wanted = {"livenessProbe": "/livez", "readinessProbe": "/readyz"}
    for kind, path in wanted.items():
        get = (probes[kind] or {}).get("httpGet") or {}
        if get.get("path") != path:
            problems.append(f"{s.where}: {kind} is not an HTTP GET of {path}")
    for kind, probe in probes.items():
        get = (probe or {}).get("httpGet")
        if get is None:
            continue
        if str(get.get("path")).split("?")[0] not in gateway_routes():
            problems.append(f"{s.where}: {kind} GETs {get.get('path')}, not a gateway route")
        if ports.get(str(get.get("port"))) != s.config.port:
            problems.append(
                f"{s.where}: {kind} port {get.get('port')} is not the port the gateway listens on"
            )
    return problems


def _health_probe_problems(s: ServiceContainer, kind: str, probe: Doc) -> list[str]:
    """An exec of ``deepinfer health --kind <command>`` that can build its Config from the env."""
    argv = [str(a) for a in (probe.get("exec") or {}).get("command") or []]
    args = parse_cli(argv[1:]) if argv[:1] == ["deepinfer"] else None
    if args is None or args.command != "health":
        return [f"{s.where}: {kind} is not an exec of `deepinfer health --kind {s.command}`"]
    problems = []
    if args.kind not in health.KINDS or args.kind != s.command:
        problems.append(f"{s.where}: {kind} checks kind {args.kind!r}, not {s.command!r}")
    # The probe runs with the container's environment: it must log in to NATS the same way.
    probe_fields = {f.name for f in dataclasses.fields(health.Config)}
    problems += [
        f"{s.where}: {kind}: `deepinfer health` does not read {key} (no {key[len(ENV_PREFIX) :].lower()} "
        "field in its Config): it cannot reach NATS as the service does"
        for key in s.env
        if key.startswith(f"{ENV_PREFIX}NATS_") and key[len(ENV_PREFIX) :].lower() not in probe_fields
    ]
    try:
        build_config(health.Config, args, s.env)
    except (ValueError, TypeError) as exc:
        problems.append(f"{s.where}: {kind}: bad health configuration: {exc}")
    return problems
