"""Loading the manifests deploy/k8s/kustomization.yaml lists, and the small readers the checks share.

No checks here: the paths and constants, the documents in order, and readers of one document (its
name, pods, containers, environment, ports, mounts) that the ``*_problems`` checkers build on.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import io
import re
from pathlib import Path
from typing import Any

import yaml

from deepinfer.cli import build_parser
from libs.runtime.settings import ENV_PREFIX

REPO = Path(__file__).resolve().parents[3]
K8S_DIR = REPO / "deploy" / "k8s"
KUSTOMIZATION = K8S_DIR / "kustomization.yaml"
# The API version the manifests are validated against: bumped on purpose, like a pinned package.
K8S_VERSION = "1.33.0"
GATEWAY_APP = REPO / "services" / "gateway" / "app.py"
GATEWAY_METRICS = REPO / "services" / "gateway" / "metrics.py"

WORKLOAD_KINDS = ("Deployment", "StatefulSet")
DEEPINFER_IMAGE = "deepinfer"
NATS_IMAGE = "nats"
NATS_CLIENT_PORT = 4222
NATS_CREDENTIALS = {"user": f"{ENV_PREFIX}NATS_USER", "password": f"{ENV_PREFIX}NATS_PASSWORD"}
GPU_RESOURCE = "nvidia.com/gpu"
MIN_SCHEDULERS = 2  # a lost scheduler's requests are resubmitted to another one
POD_NAME = "pod-name-0"  # what a metadata.name fieldRef stands for in these checks

Doc = dict[str, Any]


# ---------------------------------------------------------------- loading


def kustomization_resources() -> list[str]:
    data = yaml.safe_load(KUSTOMIZATION.read_text())
    resources = data.get("resources") if isinstance(data, dict) else None
    assert isinstance(resources, list), "kustomization.yaml lists no resources"
    return [str(r) for r in resources]


def load_manifests() -> list[tuple[str, Doc]]:
    """(file, document) for each document of each listed resource file, in order."""
    out = []
    for name in kustomization_resources():
        for doc in yaml.safe_load_all((K8S_DIR / name).read_text()):
            if doc is not None:
                out.append((name, doc))
    return out


def all_docs() -> list[Doc]:
    return [doc for _, doc in load_manifests()]


# ---------------------------------------------------------------- small readers


def doc_name(doc: Doc) -> str:
    return str((doc.get("metadata") or {}).get("name", ""))


def find_doc(docs: list[Doc], kind: str, name: str) -> Doc | None:
    return next((d for d in docs if d.get("kind") == kind and doc_name(d) == name), None)


def require_doc(docs: list[Doc], kind: str, name: str) -> Doc:
    doc = find_doc(docs, kind, name)
    assert doc is not None, f"no {kind}/{name}: the manifests changed; update this case"
    return doc


def workloads_of(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d.get("kind") in WORKLOAD_KINDS]


def pod_spec(workload: Doc) -> Doc:
    return dict(((workload.get("spec") or {}).get("template") or {}).get("spec") or {})


def pod_labels(workload: Doc) -> dict[str, str]:
    template = (workload.get("spec") or {}).get("template") or {}
    return dict((template.get("metadata") or {}).get("labels") or {})


def containers_of(workload: Doc) -> list[Doc]:
    spec = pod_spec(workload)
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def image_name(container: Doc) -> str:
    return str(container.get("image", "")).split("@")[0].rsplit(":", 1)[0].split("/")[-1]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def secret_values(secret: Doc) -> dict[str, str]:
    values = {k: base64.b64decode(str(v)).decode() for k, v in (secret.get("data") or {}).items()}
    return values | {k: str(v) for k, v in (secret.get("stringData") or {}).items()}


def key_ref_value(docs: list[Doc], source: Doc) -> str | None:
    """The value an env ``valueFrom`` names, None if nothing here holds it."""
    if "fieldRef" in source:
        return POD_NAME if source["fieldRef"].get("fieldPath") == "metadata.name" else "field"
    for ref_kind, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
        if ref_kind in source:
            ref = source[ref_kind]
            doc = find_doc(docs, kind, str(ref.get("name", "")))
            if doc is None:
                return None
            values = secret_values(doc) if kind == "Secret" else dict(doc.get("data") or {})
            value = values.get(str(ref.get("key", "")))
            return None if value is None else str(value)
    return None


def container_env(docs: list[Doc], container: Doc) -> dict[str, str]:
    """The container's environment, ``valueFrom`` resolved from the manifests where it can be."""
    out = {}
    for entry in container.get("env") or []:
        if "value" in entry:
            out[str(entry["name"])] = str(entry["value"])
        elif "valueFrom" in entry:
            value = key_ref_value(docs, entry["valueFrom"])
            if value is not None:
                out[str(entry["name"])] = value
    return out


def env_source(container: Doc, name: str) -> Doc | None:
    entry = next((e for e in container.get("env") or [] if e.get("name") == name), None)
    return None if entry is None else dict(entry.get("valueFrom") or {"value": entry.get("value")})


def container_ports(workload: Doc) -> dict[str, int]:
    """name (or the number as text) -> containerPort, over the pod's containers."""
    out = {}
    for container in containers_of(workload):
        for port in container.get("ports") or []:
            out[str(port["containerPort"])] = int(port["containerPort"])
            if "name" in port:
                out[str(port["name"])] = int(port["containerPort"])
    return out


def mount_of(workload: Doc, container: Doc, path: str) -> tuple[Doc, Doc] | None:
    """(volumeMount, volume) of the deepest mount holding ``path``; the volume of a StatefulSet's
    volumeClaimTemplate is ``{"volumeClaimTemplate": <template>}``."""
    norm = path.rstrip("/") or "/"
    best: tuple[Doc, Doc] | None = None
    for mount in container.get("volumeMounts") or []:
        target = str(mount.get("mountPath", "")).rstrip("/") or "/"
        if norm != target and not norm.startswith(target.rstrip("/") + "/"):
            continue
        if best is not None and len(str(best[0]["mountPath"])) >= len(target):
            continue
        volume = volume_of(workload, str(mount.get("name")))
        if volume is not None:
            best = (mount, volume)
    return best


def volume_of(workload: Doc, name: str) -> Doc | None:
    volume = next((v for v in pod_spec(workload).get("volumes") or [] if v.get("name") == name), None)
    if volume is not None:
        return dict(volume)
    for template in (workload.get("spec") or {}).get("volumeClaimTemplates") or []:
        if (template.get("metadata") or {}).get("name") == name:
            return {"name": name, "volumeClaimTemplate": template}
    return None


def mounted_key(path: str, mount: Doc, source: Doc) -> str:
    """The key of a Secret or ConfigMap volume ``source`` (mounted by ``mount``) that ``path`` shows."""
    relative = path[len(str(mount["mountPath"]).rstrip("/")) + 1 :]
    items = {str(i["path"]): str(i["key"]) for i in source.get("items") or []}
    return items.get(relative, relative if not items else "")


_QUANTITY_UNITS = {
    "": 1,
    "k": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
}


def parse_quantity(text: str) -> float:
    """A Kubernetes quantity (``100Gi``, ``500M``, ``1e3``) in base units."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?(?:[eE]\d+)?)([A-Za-z]*)", str(text).strip())
    if m is None or m.group(2) not in _QUANTITY_UNITS:
        raise ValueError(f"not a quantity: {text!r}")
    return float(m.group(1)) * _QUANTITY_UNITS[m.group(2)]


def parse_cli(argv: list[str]) -> Any:
    """argparse's result, or None (argparse exits on a bad command line)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return build_parser().parse_args(argv)
    except SystemExit:
        return None


def _call_string_args(path: Path, callees: set[str]) -> set[str]:
    """The string first arguments of calls to ``callees`` in a module's source (its routes, its
    metrics), read without importing it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        arg = node.args[0]
        if name in callees and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            out.add(arg.value)
    return out


def gateway_routes() -> set[str]:
    return _call_string_args(GATEWAY_APP, {"Route"})


def gateway_gauges() -> set[str]:
    return _call_string_args(GATEWAY_METRICS, {"Gauge", "GaugeMetricFamily"})
