"""Checks the HorizontalPodAutoscaler: it scales the gateway on a gauge the gateway exports."""

from __future__ import annotations

from tests.unit.k8s.check_containers import service_of
from tests.unit.k8s.manifests import Doc, containers_of, doc_name, find_doc, gateway_gauges, workloads_of


def autoscaler_problems(docs: list[Doc]) -> list[str]:
    """The gateway scales on a gauge it exports, averaged over its pods."""
    hpas = [d for d in docs if d.get("kind") == "HorizontalPodAutoscaler"]
    if not hpas:
        return ["no HorizontalPodAutoscaler for the gateway"]
    problems = []
    for hpa in hpas:
        where = f"HorizontalPodAutoscaler/{doc_name(hpa)}"
        spec = hpa.get("spec") or {}
        ref = spec.get("scaleTargetRef") or {}
        target = find_doc(workloads_of(docs), str(ref.get("kind")), str(ref.get("name")))
        commands = [(service_of(c) or ("",))[0] for c in containers_of(target or {})]
        if "gateway" not in commands:
            problems.append(f"{where}: does not scale the gateway")
        if int(spec.get("minReplicas", 1)) > int(spec.get("maxReplicas", 0)):
            problems.append(f"{where}: minReplicas above maxReplicas")
        problems += _metric_problems(where, spec.get("metrics") or [])
    return problems


def _metric_problems(where: str, metrics: list[Doc]) -> list[str]:
    problems = [] if metrics else [f"{where}: no metrics"]
    for metric in metrics:
        pods = metric.get("pods") or {}
        name = (pods.get("metric") or {}).get("name")
        if metric.get("type") != "Pods" or name not in gateway_gauges():
            problems.append(f"{where}: metric {name!r} is not a Pods metric of a gauge the gateway exports")
        if (pods.get("target") or {}).get("type") != "AverageValue":
            problems.append(f"{where}: metric {name!r}: the target is not an AverageValue per pod")
    return problems
