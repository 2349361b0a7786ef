"""Checks that the manifests refer to each other correctly: the listing, references and selectors.

Each file is listed once; every Secret, ConfigMap, claim and volume a pod uses exists; selectors
find their own pods and only those; Services reach ports their pods expose.
"""

from __future__ import annotations

from pathlib import Path

from tests.unit.k8s.manifests import (
    KUSTOMIZATION,
    Doc,
    container_ports,
    containers_of,
    doc_name,
    find_doc,
    key_ref_value,
    pod_labels,
    pod_spec,
    secret_values,
    selects,
    volume_of,
    workloads_of,
)

# (volume field, kind, the field naming the object) of the volumes whose keys are checked
_KEYED_VOLUMES = (("secret", "Secret", "secretName"), ("configMap", "ConfigMap", "name"))
_ENV_REFS = (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap"))
_ENV_FROM_REFS = (("secretRef", "Secret"), ("configMapRef", "ConfigMap"))


def listing_problems(resources: list[str], k8s_dir: Path) -> list[str]:
    """Each listed file exists, once; each manifest file of the directory is listed."""
    problems = [f"{r}: listed twice" for r in sorted({r for r in resources if resources.count(r) > 1})]
    problems += [f"{r}: listed but missing" for r in resources if not (k8s_dir / r).is_file()]
    on_disk = {p.name for p in k8s_dir.iterdir() if p.suffix in (".yaml", ".yml")} - {KUSTOMIZATION.name}
    problems += [f"{f}: not listed in {KUSTOMIZATION.name}" for f in sorted(on_disk - set(resources))]
    return problems


# ---------------------------------------------------------------- references


def reference_problems(docs: list[Doc]) -> list[str]:
    """Every Secret, ConfigMap (and key), claim and volume a pod uses exists; a claim that one
    node mounts (ReadWriteOnce) is not shared by pods that may run on several."""
    problems = []
    claim_users: dict[str, int] = {}
    for workload in workloads_of(docs):
        where = f"{workload['kind']}/{doc_name(workload)}"
        replicas = int((workload.get("spec") or {}).get("replicas", 1))
        for volume in pod_spec(workload).get("volumes") or []:
            found, claim_name = _volume_problems(docs, where, volume)
            problems += found
            if claim_name is not None:
                claim_users[claim_name] = claim_users.get(claim_name, 0) + replicas
        for container in containers_of(workload):
            problems += _container_reference_problems(docs, where, workload, container)
    return problems + _claim_sharing_problems(docs, claim_users)


def _volume_problems(docs: list[Doc], where: str, volume: Doc) -> tuple[list[str], str | None]:
    """One pod volume's missing objects and keys, and the claim it mounts (None: no claim here)."""
    problems: list[str] = []
    for field, kind, name_field in _KEYED_VOLUMES:
        if field not in volume:
            continue
        source_name = str(volume[field].get(name_field, ""))
        source = find_doc(docs, kind, source_name)
        if source is None:
            return [*problems, f"{where}: volume {volume['name']}: no {kind} {source_name!r}"], None
        keys = set(secret_values(source)) if kind == "Secret" else set(source.get("data") or {})
        problems += [
            f"{where}: volume {volume['name']}: {kind} {source_name!r} has no key {item['key']!r}"
            for item in volume[field].get("items") or []
            if item["key"] not in keys
        ]
    if "persistentVolumeClaim" not in volume:
        return problems, None
    claim_name = str(volume["persistentVolumeClaim"].get("claimName", ""))
    if find_doc(docs, "PersistentVolumeClaim", claim_name) is None:
        return [*problems, f"{where}: volume {volume['name']}: no PersistentVolumeClaim {claim_name!r}"], None
    return problems, claim_name


def _container_reference_problems(docs: list[Doc], where: str, workload: Doc, container: Doc) -> list[str]:
    """The container's mounts name volumes of its pod; its env and envFrom name objects that exist."""
    problems = [
        f"{where}: {container['name']} mounts {mount.get('name')!r}: no such volume"
        for mount in container.get("volumeMounts") or []
        if volume_of(workload, str(mount.get("name"))) is None
    ]
    for entry in container.get("env") or []:
        source = entry.get("valueFrom") or {}
        for ref_kind, kind in _ENV_REFS:
            if ref_kind in source and key_ref_value(docs, source) is None:
                ref = source[ref_kind]
                problems.append(
                    f"{where}: {container['name']} env {entry['name']}: no {kind} "
                    f"{ref.get('name')!r} with key {ref.get('key')!r}"
                )
    for source in container.get("envFrom") or []:
        for ref_kind, kind in _ENV_FROM_REFS:
            if ref_kind in source and find_doc(docs, kind, str(source[ref_kind].get("name"))) is None:
                problems.append(f"{where}: {container['name']} envFrom: no {kind} {source[ref_kind]}")
    return problems


def _claim_sharing_problems(docs: list[Doc], claim_users: dict[str, int]) -> list[str]:
    problems = []
    for claim_name, users in claim_users.items():
        claim = find_doc(docs, "PersistentVolumeClaim", claim_name)
        modes = ((claim or {}).get("spec") or {}).get("accessModes") or []
        if users > 1 and "ReadWriteMany" not in modes:
            problems.append(
                f"PersistentVolumeClaim/{claim_name} is {modes}, but pods on several nodes mount it"
            )
    return problems


# ---------------------------------------------------------------- selectors


def selector_problems(docs: list[Doc]) -> list[str]:
    """Each workload's selector matches its own pods and no other workload's; each Service selects
    pods that have its target ports; a StatefulSet's service is headless; an autoscaler targets a
    workload that exists."""
    problems = []
    workloads = workloads_of(docs)
    for workload in workloads:
        problems += _workload_selector_problems(docs, workload, workloads)
    for service in (d for d in docs if d.get("kind") == "Service"):
        problems += _service_selector_problems(service, workloads)
    for hpa in (d for d in docs if d.get("kind") == "HorizontalPodAutoscaler"):
        ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
        if find_doc(workloads, str(ref.get("kind")), str(ref.get("name"))) is None:
            problems.append(
                f"HorizontalPodAutoscaler/{doc_name(hpa)}: no {ref.get('kind')}/{ref.get('name')}"
            )
    return problems


def _workload_selector_problems(docs: list[Doc], workload: Doc, workloads: list[Doc]) -> list[str]:
    """The workload's selector, its pods' anti-affinity and (a StatefulSet's) headless Service."""
    problems = []
    where = f"{workload['kind']}/{doc_name(workload)}"
    selector = ((workload.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    if not selects(selector, pod_labels(workload)):
        problems.append(f"{where}: selector {selector} does not match its pod labels {pod_labels(workload)}")
    problems += [
        f"{where}: selector {selector} also matches the pods of {other['kind']}/{doc_name(other)}"
        for other in workloads
        if other is not workload and selects(selector, pod_labels(other))
    ]
    affinity = pod_spec(workload).get("affinity") or {}
    for rule in (affinity.get("podAntiAffinity") or {}).values():
        for term in rule:
            term = term.get("podAffinityTerm", term)
            labels = (term.get("labelSelector") or {}).get("matchLabels") or {}
            if not any(selects(labels, pod_labels(w)) for w in workloads):
                problems.append(f"{where}: anti-affinity selector {labels} matches no pods")
    if workload["kind"] == "StatefulSet":
        problems += _headless_service_problems(docs, where, workload)
    return problems


def _headless_service_problems(docs: list[Doc], where: str, workload: Doc) -> list[str]:
    service_name = (workload.get("spec") or {}).get("serviceName")
    service = find_doc(docs, "Service", str(service_name))
    if service is None:
        return [f"{where}: serviceName {service_name!r}: no such Service"]
    if (service.get("spec") or {}).get("clusterIP") != "None":
        return [f"{where}: serviceName {service_name!r} is not headless (clusterIP: None)"]
    if not selects((service.get("spec") or {}).get("selector") or {}, pod_labels(workload)):
        return [f"{where}: its Service {service_name!r} does not select its pods"]
    return []


def _service_selector_problems(service: Doc, workloads: list[Doc]) -> list[str]:
    where = f"Service/{doc_name(service)}"
    selector = (service.get("spec") or {}).get("selector") or {}
    selected = [w for w in workloads if selects(selector, pod_labels(w))]
    if not selected:
        return [f"{where}: selector {selector} matches no pods"]
    problems = []
    for port in (service.get("spec") or {}).get("ports") or []:
        target = str(port.get("targetPort", port.get("port")))
        problems += [
            f"{where}: port {port.get('name', port.get('port'))} targets {target}, which "
            f"{w['kind']}/{doc_name(w)} does not expose"
            for w in selected
            if target not in container_ports(w)
        ]
    return problems
