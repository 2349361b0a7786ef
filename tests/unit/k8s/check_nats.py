"""Checks the NATS StatefulSet and the nats.conf its ConfigMap holds against each other.

``nats_problems`` also returns the ``NatsFacts`` (client port, pod labels, login Secret keys) that
the deepinfer containers must then agree with.
"""

from __future__ import annotations

import dataclasses

from libs.bus.nats_server import MAX_PAYLOAD
from tests.unit.compose.nats_conf import parse_nats_conf, parse_size
from tests.unit.k8s.manifests import (
    NATS_CLIENT_PORT,
    NATS_CREDENTIALS,
    NATS_IMAGE,
    Doc,
    container_ports,
    containers_of,
    doc_name,
    find_doc,
    image_name,
    mount_of,
    mounted_key,
    pod_labels,
    workloads_of,
)


@dataclasses.dataclass
class NatsFacts:
    """What the deepinfer containers must agree with: where clients connect, and the login."""

    client_port: int = NATS_CLIENT_PORT
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    credentials: dict[str, Doc] = dataclasses.field(default_factory=dict)  # "user" -> secretKeyRef


def _flag_value(argv: list[str], *names: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg in names and i + 1 < len(argv):
            return argv[i + 1]
    return None


def nats_problems(docs: list[Doc]) -> tuple[list[str], NatsFacts]:
    """The nats StatefulSet: a 3+ server cluster whose config (from its ConfigMap) routes to each
    server by its stable name, keeps JetStream on the claim templates, logs clients in from a
    Secret, and allows the bus's message size."""
    facts = NatsFacts()
    found = [(w, c) for w in workloads_of(docs) for c in containers_of(w) if image_name(c) == NATS_IMAGE]
    if len(found) != 1 or found[0][0]["kind"] != "StatefulSet":
        return ["nats: not one StatefulSet running the nats image"], facts
    sts, container = found[0]
    facts.labels = pod_labels(sts)
    problems = []
    replicas = int((sts.get("spec") or {}).get("replicas", 1))
    if replicas < 3 or replicas % 2 == 0:
        problems.append(f"nats: {replicas} servers: JetStream's quorum needs an odd number, 3 or more")
    conf, missing = _nats_conf(docs, sts, container)
    if conf is None:
        return [*problems, missing], facts
    env_sources = {str(e["name"]): dict(e.get("valueFrom") or {}) for e in container.get("env") or []}
    problems += _server_problems(sts, container, conf, env_sources)
    problems += _port_problems(docs, sts, conf, facts)
    problems += _authorization_problems(conf, env_sources, facts)
    return problems, facts


def _nats_conf(docs: list[Doc], sts: Doc, container: Doc) -> tuple[dict[str, str] | None, str]:
    """The parsed config file the server's ``-c`` names, or None and why it cannot be read."""
    argv = [str(a) for a in container.get("args") or []]
    conf_path = _flag_value(argv, "-c", "--config")
    if conf_path is None:
        return None, "nats: no config file (-c): max_payload and the cluster need one"
    mounted = mount_of(sts, container, conf_path)
    if mounted is None or "configMap" not in mounted[1]:
        return None, f"nats: config {conf_path} is not mounted from a ConfigMap"
    mount, volume = mounted
    key = mounted_key(conf_path, mount, volume["configMap"])
    cm = find_doc(docs, "ConfigMap", str(volume["configMap"].get("name")))
    text = ((cm or {}).get("data") or {}).get(key)
    if text is None:
        return None, f"nats: config {conf_path}: its ConfigMap has no key {key!r}"
    return parse_nats_conf(str(text)), ""


def _server_problems(
    sts: Doc, container: Doc, conf: dict[str, str], env_sources: dict[str, Doc]
) -> list[str]:
    """The message size, JetStream's store on a claim template, the server named after its pod."""
    problems = []
    payload = conf.get("max_payload")
    if payload is None or parse_size(payload) != parse_size(MAX_PAYLOAD):
        problems.append(f"nats: max_payload {payload} != {MAX_PAYLOAD}")
    store_dir = conf.get("jetstream.store_dir")
    on = None if store_dir is None else mount_of(sts, container, store_dir)
    if "jetstream" not in conf or store_dir is None:
        problems.append("nats: no jetstream block with a store_dir")
    elif on is None or "volumeClaimTemplate" not in on[1]:
        problems.append(f"nats: JetStream store {store_dir} is not on a volumeClaimTemplate")
    server_name = conf.get("server_name", "")
    fields = (env_sources.get(server_name[1:]) or {}).get("fieldRef") or {}
    if fields.get("fieldPath") != "metadata.name":
        problems.append(f"nats: server_name {server_name!r} is not $VAR of the pod's name (a fieldRef)")
    return problems


def _port_problems(docs: list[Doc], sts: Doc, conf: dict[str, str], facts: NatsFacts) -> list[str]:
    """The client port is a containerPort (noted in ``facts``); the cluster routes reach every
    server through the headless Service."""
    problems = []
    facts.client_port = int(conf.get("port", NATS_CLIENT_PORT))
    if str(facts.client_port) not in container_ports(sts):
        problems.append(f"nats: client port {facts.client_port} is not a containerPort")
    cluster_port = conf.get("cluster.port")
    if cluster_port is None:
        return [*problems, "nats: no cluster block with a port"]
    spec = sts.get("spec") or {}
    headless = find_doc(docs, "Service", str(spec.get("serviceName")))
    ports = container_ports(sts)
    service_ports = [
        int(p["port"])
        for p in ((headless or {}).get("spec") or {}).get("ports") or []
        if ports.get(str(p.get("targetPort", p.get("port")))) == int(cluster_port)
    ]
    if not service_ports:
        return [*problems, f"nats: the headless Service has no port to the cluster port {cluster_port}"]
    wanted = {
        f"nats://{doc_name(sts)}-{i}.{spec.get('serviceName')}:{service_ports[0]}"
        for i in range(int(spec.get("replicas", 1)))
    }
    routes = set(filter(None, conf.get("cluster.routes", "").split(",")))
    if routes != wanted:
        problems.append(f"nats: cluster routes {sorted(routes)} are not every server: {sorted(wanted)}")
    return problems


def _authorization_problems(conf: dict[str, str], env_sources: dict[str, Doc], facts: NatsFacts) -> list[str]:
    """Clients log in with a user and password that are $VARs of a Secret's keys (noted in ``facts``)."""
    problems = []
    if "authorization" not in conf:
        problems.append("nats: no authorization block: anyone who reaches the port may publish")
    for field_name in NATS_CREDENTIALS:
        value = conf.get(f"authorization.{field_name}", "")
        ref = (env_sources.get(value[1:]) or {}).get("secretKeyRef")
        if not value.startswith("$") or ref is None:
            problems.append(f"nats: authorization {field_name} {value!r} is not $VAR of a Secret's key")
        else:
            facts.credentials[field_name] = dict(ref)
    return problems
