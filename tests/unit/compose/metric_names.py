"""The metric names deepinfer exports, read from the code (every prometheus_client constructor in
the modules that import it, its name resolved as far as reading can; the kvcache's table of
specs; the process collector), and the metric names a PromQL expression or a Grafana dashboard
reads."""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector

REPO = Path(__file__).resolve().parents[3]

# ---------------------------------------------------------------- what the code exports

# prometheus_client constructor -> its metric type
CONSTRUCTORS = {
    "Counter": "counter",
    "Gauge": "gauge",
    "Histogram": "histogram",
    "Summary": "summary",
    "CounterMetricFamily": "counter",
    "GaugeMetricFamily": "gauge",
    "HistogramMetricFamily": "histogram",
    "UnknownMetricFamily": "unknown",
}
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "unknown": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
}
# Families named at run time: the KV-cache stats the publishers send (``deepinfer_kv_<stat>``).
DYNAMIC = {("services/gateway/fleet_metrics.py", "UnknownMetricFamily")}


def _strings(scope: ast.AST) -> dict[str, str]:
    """``name = "..."`` and ``a, b = "...", x`` in ``scope`` (a module or one function)."""
    found: dict[str, str] = {}
    for node in ast.walk(scope):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        pairs = (
            zip(target.elts, value.elts, strict=True)
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
            else [(target, value)]
        )
        for name, const in pairs:
            if (
                isinstance(name, ast.Name)
                and isinstance(const, ast.Constant)
                and isinstance(const.value, str)
            ):
                found[name.id] = const.value
    return found


def _calls(tree: ast.Module) -> Iterator[tuple[ast.Call, dict[str, str]]]:
    """Every call, with the strings its enclosing function assigns."""
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    inside = {id(call): f for f in functions for call in ast.walk(f) if isinstance(call, ast.Call)}
    scopes = {id(f): _strings(f) for f in functions}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = inside.get(id(node))
            yield node, scopes[id(f)] if f is not None else {}


def scan_module(path: Path) -> tuple[dict[str, str], set[tuple[str, str]]]:
    """(metric family -> type) of every prometheus_client constructor in ``path``, and the
    constructors whose name is not a string this reading can resolve."""
    relative = path.relative_to(REPO).as_posix()
    module = importlib.import_module(relative.removesuffix(".py").replace("/", "."))
    tree = ast.parse(path.read_text())
    # the constructors this module imports from prometheus_client (collections.Counter is not one)
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prometheus_client")
        for alias in node.names
    }
    families, unresolved = {}, set()
    for call, local in _calls(tree):
        func = call.func
        kind = func.id if isinstance(func, ast.Name) else ""
        if kind not in CONSTRUCTORS or kind not in imported or not call.args:
            continue
        arg = call.args[0]
        name: object = None
        if isinstance(arg, ast.Constant):
            name = arg.value
        elif isinstance(arg, ast.Name):
            name = local.get(arg.id, getattr(module, arg.id, None))
        if isinstance(name, str):
            families[name.removesuffix("_total") if kind.startswith("Counter") else name] = CONSTRUCTORS[kind]
        else:
            unresolved.add((relative, kind))
    return families, unresolved


def metric_modules() -> list[Path]:
    return sorted(
        p
        for top in ("libs", "services", "deepinfer")
        for p in (REPO / top).rglob("*.py")
        if "prometheus_client" in p.read_text()
    )


def exported_metrics() -> tuple[set[str], set[tuple[str, str]]]:
    """Every sample name the services, serve and their processes export; and what was unresolved."""
    families: dict[str, str] = {}
    unresolved: set[tuple[str, str]] = set()
    for path in metric_modules():
        found, missed = scan_module(path)
        families |= found
        unresolved |= missed
    kvcache = importlib.import_module("services.kvcache.metrics")  # a table: stat -> metric spec
    families |= {spec.metric: "counter" if spec.counter else "gauge" for spec in kvcache.SPECS.values()}
    names = {family + suffix for family, kind in families.items() for suffix in SUFFIXES[kind]}
    process = CollectorRegistry()
    ProcessCollector(registry=process)
    names |= {sample.name for metric in process.collect() for sample in metric.samples}
    return names, unresolved


# ---------------------------------------------------------------- the Grafana dashboard

PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "group_left", "group_right"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.:])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()")


def promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, label names and keywords left out)."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\$\{?\w+\}?", "1m", text)  # Grafana's variables ($__rate_interval)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", text)  # matchers, ranges
    text = _GROUPING.sub("", text)
    return {name for name in _IDENTIFIER.findall(text) if name.lower() not in PROMQL_WORDS}


def dashboard_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # a collapsed row's


def dashboard_problems(dashboard: dict[str, Any], exported: set[str], datasource_uid: str) -> list[str]:
    problems, ids = [], set()
    for panel in dashboard_panels(dashboard):
        title = panel.get("title", "?")
        if panel.get("id") in ids:
            problems.append(f"panel {title!r}: id {panel.get('id')} used twice")
        ids.add(panel.get("id"))
        if panel.get("type") == "row":
            continue
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"panel {title!r}: no query")
        for source in [panel.get("datasource"), *(t.get("datasource") for t in targets)]:
            if not isinstance(source, dict) or source.get("uid") != datasource_uid:
                problems.append(
                    f"panel {title!r}: datasource {source} is not the provisioned {datasource_uid!r}"
                )
        for target in targets:
            problems += [
                f"panel {title!r}: {name} is not a metric deepinfer exports"
                for name in sorted(promql_metrics(str(target.get("expr", ""))) - exported)
            ]
    return problems
