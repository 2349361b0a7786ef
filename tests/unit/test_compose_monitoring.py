"""Static checks of the compose stack's monitoring profile: Prometheus scrapes every service that
serves /metrics, on the port it serves it on, and the Grafana dashboard queries only metrics the
code exports (found by reading the metrics modules, as they are, and collecting the registries
that exist at import). Each check returns readable problems; broken copies must each be caught.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from deepinfer.cli import SERVICES
from libs.runtime.settings import build_config
from tests.unit.metric_names import (
    DYNAMIC,
    SUFFIXES,
    dashboard_panels,
    dashboard_problems,
    exported_metrics,
    promql_metrics,
)
from tests.unit.test_compose import (
    COMPOSE_DIR,
    REPO,
    _environment,
    _load_compose,
    _parse_args,
    _string_list,
    _volume_mounts,
)

PROMETHEUS_FILE = COMPOSE_DIR / "prometheus.yml"
GRAFANA_DIR = COMPOSE_DIR / "grafana"
DASHBOARD_FILE = GRAFANA_DIR / "deepinfer-dashboard.json"
DATASOURCES_FILE = GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS_FILE = GRAFANA_DIR / "provisioning" / "dashboards" / "deepinfer.yml"
PROFILE = "monitoring"
PROMETHEUS_PORT = 9090  # its default --web.listen-address

# ---------------------------------------------------------------- Prometheus and Grafana in compose


def metrics_port(service: dict[str, Any]) -> int | None:
    """The port a deepinfer service serves /metrics on (the gateway: its HTTP port); None: none."""
    command = _string_list(service.get("command")) if "build" in service else None
    args = _parse_args(command)[0] if command else None
    if args is None or args.command not in SERVICES:
        return None
    config: Any = build_config(SERVICES[args.command][1], args, _environment(service))
    port = int(config.port if args.command == "gateway" else getattr(config, "metrics_port", 0))
    return port or None


def scrape_targets(conf: dict[str, Any]) -> Iterator[tuple[str, str, int]]:
    """(job, host, port) of every static target and DNS name of the scrape config."""
    for job in conf.get("scrape_configs") or []:
        name = str(job.get("job_name"))
        for static in job.get("static_configs") or []:
            for target in static.get("targets") or []:
                host, _, port = str(target).rpartition(":")
                yield name, host, int(port or 0)
        for dns in job.get("dns_sd_configs") or []:
            for host in dns.get("names") or []:
                yield name, str(host), int(dns.get("port", 0))


def _pinned(name: str, service: dict[str, Any]) -> list[str]:
    image = str(service.get("image", ""))
    tag = image.rpartition(":")[2] if ":" in image else ""
    return [] if tag and tag != "latest" else [f"{name}: image {image!r} is not pinned to a version"]


def _mounted(service: dict[str, Any], source: Path, target: str) -> bool:
    return any(
        (COMPOSE_DIR / s).resolve() == source.resolve() and t == target for s, t in _volume_mounts(service)
    )


def prometheus_problems(compose: dict[str, Any], conf: dict[str, Any]) -> list[str]:
    services = compose.get("services", {})
    prometheus = services.get("prometheus")
    if not isinstance(prometheus, dict):
        return ["no 'prometheus' service"]
    problems = _pinned("prometheus", prometheus)
    if prometheus.get("profiles") != [PROFILE]:
        problems.append(f"prometheus: not in (only) the {PROFILE!r} profile")
    argv = _string_list(prometheus.get("command") or []) or []
    config_file = next((a.split("=", 1)[1] for a in argv if a.startswith("--config.file=")), "")
    if not config_file or not _mounted(prometheus, PROMETHEUS_FILE, config_file):
        problems.append(f"prometheus: {PROMETHEUS_FILE.name} is not mounted where --config.file reads")
    scraped = set()
    for job, host, port in scrape_targets(conf):
        serving = metrics_port(services[host]) if isinstance(services.get(host), dict) else None
        if serving is None:
            problems.append(f"job {job}: {host} is not a compose service serving /metrics")
        elif port != serving:
            problems.append(f"job {job}: {host}:{port}, but {host} serves /metrics on port {serving}")
        else:
            scraped.add(host)
    for job in conf.get("scrape_configs") or []:
        if job.get("metrics_path", "/metrics") != "/metrics" or job.get("scheme", "http") != "http":
            problems.append(f"job {job.get('job_name')}: not http /metrics")
    problems += [
        f"{name}: serves /metrics on port {serving}, which no scrape job reaches"
        for name, service in services.items()
        if isinstance(service, dict) and (serving := metrics_port(service)) and name not in scraped
    ]
    return problems


def grafana_problems(
    compose: dict[str, Any], datasources: dict[str, Any], providers: dict[str, Any]
) -> tuple[list[str], str]:
    """Problems of the grafana service and its provisioning; and the datasource's uid."""
    services = compose.get("services", {})
    grafana = services.get("grafana")
    if not isinstance(grafana, dict):
        return ["no 'grafana' service"], ""
    problems = _pinned("grafana", grafana)
    if grafana.get("profiles") != [PROFILE]:
        problems.append(f"grafana: not in (only) the {PROFILE!r} profile")
    if not _mounted(grafana, GRAFANA_DIR / "provisioning", "/etc/grafana/provisioning"):
        problems.append("grafana: provisioning is not mounted on /etc/grafana/provisioning")
    sources = datasources.get("datasources") or []
    url = urlsplit(str(sources[0].get("url", ""))) if len(sources) == 1 else None
    if url is None or url.hostname != "prometheus" or (url.port or 80) != PROMETHEUS_PORT:
        problems.append(f"grafana: the datasource is not the prometheus service on {PROMETHEUS_PORT}")
    paths = [str((p.get("options") or {}).get("path", "")) for p in providers.get("providers") or []]
    target = f"{paths[0].rstrip('/')}/{DASHBOARD_FILE.name}" if len(paths) == 1 else ""
    if not target or not _mounted(grafana, DASHBOARD_FILE, target):
        problems.append(f"grafana: {DASHBOARD_FILE.name} is not mounted in the provider's path {paths}")
    home = _environment(grafana).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH", "")
    if home != target:
        problems.append(f"grafana: the home dashboard {home!r} is not {target!r}")
    return problems, str(sources[0].get("uid", "")) if len(sources) == 1 else ""


# ---------------------------------------------------------------- tests: the real files


def _yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def _dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD_FILE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def exported() -> set[str]:
    names, unresolved = exported_metrics()
    assert unresolved == DYNAMIC, f"metric constructors whose name this scan cannot read: {unresolved}"
    return names


def test_scan_finds_what_the_registries_hold(exported: set[str]) -> None:
    """The scan of the source finds what the registries that exist at import hold, and the
    families that only collectors make at scrape time (gateway, worker, kvcache)."""
    registries = {"services.scheduler.metrics": "EVENTS", "services.worker.metrics": "EVENTS"}
    registries["deepinfer.supervisor"] = "REGISTRY"  # deepinfer serve's own
    for module, attribute in registries.items():
        registry = getattr(importlib.import_module(module), attribute)
        assert {s.name for m in registry.collect() for s in m.samples} <= exported, module
    # the scheduler's queue families, collected with no worker: named, without samples
    queues = importlib.import_module("services.scheduler.metrics").registry({})
    assert {m.name + suffix for m in queues.collect() for suffix in SUFFIXES[m.type]} <= exported
    for name in (
        "deepinfer_requests_total",
        "deepinfer_time_to_first_token_seconds_bucket",
        "deepinfer_kv_hit_rate",
        "deepinfer_workers",
        "deepinfer_revenue_dollars_total",
        "deepinfer_rental_per_device_hour_dollars",
        "deepinfer_kvcache_stored_bytes",
        "deepinfer_worker_num_running_seqs",
        "process_resident_memory_bytes",
    ):
        assert name in exported, name
    assert "deepinfer_requests" not in exported and "deepinfer_requests_total_total" not in exported


def test_prometheus_scrapes_every_metrics_port() -> None:
    assert prometheus_problems(_load_compose(), _yaml(PROMETHEUS_FILE)) == []


def test_grafana_is_provisioned() -> None:
    problems, uid = grafana_problems(_load_compose(), _yaml(DATASOURCES_FILE), _yaml(PROVIDERS_FILE))
    assert problems == [] and uid


def test_dashboard_queries_exported_metrics(exported: set[str]) -> None:
    uid = grafana_problems(_load_compose(), _yaml(DATASOURCES_FILE), _yaml(PROVIDERS_FILE))[1]
    dashboard = _dashboard()
    assert dashboard_problems(dashboard, exported, uid) == []
    queried = {
        n
        for p in dashboard_panels(dashboard)
        for t in p.get("targets", [])
        for n in promql_metrics(t["expr"])
    }
    for needed in (
        "deepinfer_num_requests_waiting",
        "deepinfer_step_seconds_bucket",
        "deepinfer_gross_margin_ratio",
    ):
        assert needed in queried, needed


def test_docs_list_every_metric(exported: set[str]) -> None:
    docs = (REPO / "docs" / "metrics.md").read_text()
    families = {
        re.sub(r"_(bucket|sum|count)$", "", name) for name in exported if name.startswith("deepinfer_")
    }
    assert {name for name in families if f"`{name}`" not in docs} == set()


def test_promql_metrics() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le) "
        '(rate(a_seconds_bucket{api="chat",x=~"b|c"}[$__rate_interval]))) / on (job) group_left '
        "b:rule offset 5m + 1e3 * sum without (instance) (vllm:num_requests_running)"
    )
    assert promql_metrics(expr) == {"a_seconds_bucket", "b:rule", "vllm:num_requests_running"}


# ---------------------------------------------------------------- tests: broken copies are caught

Mutation = Callable[[dict[str, Any], dict[str, Any]], Any]  # (compose, prometheus.yml)


def _job(conf: dict[str, Any], name: str) -> dict[str, Any]:
    return next(j for j in conf["scrape_configs"] if j["job_name"] == name)


SCRAPE_BREAKAGES: dict[str, tuple[Mutation, str]] = {
    "gateway port": (
        lambda c, p: _job(p, "gateway").update(static_configs=[{"targets": ["gateway:8080"]}]),
        "gateway serves /metrics on port 8000",
    ),
    "worker port": (lambda c, p: _job(p, "worker")["dns_sd_configs"][0].update(port=9200), "worker:9200"),
    "no kvcache job": (
        lambda c, p: p["scrape_configs"].remove(_job(p, "kvcache")),
        "kvcache: serves /metrics on port 9100, which no scrape job reaches",
    ),
    "unknown host": (
        lambda c, p: _job(p, "scheduler")["dns_sd_configs"][0].update(names=["schedulers"]),
        "schedulers is not a compose service",
    ),
    "metrics port off": (
        lambda c, p: c["services"]["scheduler"]["environment"].pop("DEEPINFER_METRICS_PORT"),
        "scheduler is not a compose service serving /metrics",
    ),
    "nats scraped": (
        lambda c, p: _job(p, "gateway").update(static_configs=[{"targets": ["gateway:8000", "nats:8222"]}]),
        "nats is not a compose service serving /metrics",
    ),
    "config not mounted": (
        lambda c, p: c["services"]["prometheus"].update(volumes=["prometheus-data:/prometheus"]),
        "not mounted where --config.file reads",
    ),
    "latest": (lambda c, p: c["services"]["prometheus"].update(image="prom/prometheus"), "not pinned"),
    "no profile": (lambda c, p: c["services"]["prometheus"].pop("profiles"), "the 'monitoring' profile"),
    "path": (lambda c, p: _job(p, "worker").update(metrics_path="/stats"), "not http /metrics"),
}


@pytest.mark.parametrize("case", sorted(SCRAPE_BREAKAGES))
def test_scrape_checker_catches(case: str) -> None:
    compose, conf = copy.deepcopy(_load_compose()), _yaml(PROMETHEUS_FILE)
    mutate, expected = SCRAPE_BREAKAGES[case]
    mutate(compose, conf)
    problems = prometheus_problems(compose, conf)
    assert any(expected in p for p in problems), problems


GRAFANA_BREAKAGES: dict[str, tuple[Callable[[dict[str, Any], dict[str, Any]], Any], str]] = {
    "datasource url": (lambda g, d: d["datasources"][0].update(url="http://prometheus:9091"), "datasource"),
    "provider path": (
        lambda g, d: g.update(volumes=g["volumes"][:1]),
        "is not mounted in the provider's path",
    ),
    "home": (
        lambda g, d: g["environment"].pop("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"),
        "home dashboard",
    ),
    "unpinned": (lambda g, d: g.update(image="grafana/grafana:latest"), "not pinned"),
    "provisioning": (lambda g, d: g.update(volumes=g["volumes"][1:]), "provisioning is not mounted"),
}


@pytest.mark.parametrize("case", sorted(GRAFANA_BREAKAGES))
def test_grafana_checker_catches(case: str) -> None:
    compose, datasources = copy.deepcopy(_load_compose()), _yaml(DATASOURCES_FILE)
    mutate, expected = GRAFANA_BREAKAGES[case]
    mutate(compose["services"]["grafana"], datasources)
    problems = grafana_problems(compose, datasources, _yaml(PROVIDERS_FILE))[0]
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("sum(rate(deepinfer_generation_token_total[5m]))", "deepinfer_generation_token_total is not"),
        ("vllm:num_requests_running", "vllm:num_requests_running is not"),
        ("deepinfer_requests", "deepinfer_requests is not"),  # a counter is read by its _total
        ("deepinfer_step_seconds", "deepinfer_step_seconds is not"),  # a histogram by its series
    ],
)
def test_dashboard_checker_catches(exported: set[str], expr: str, expected: str) -> None:
    dashboard = _dashboard()
    panel = next(p for p in dashboard["panels"] if p.get("targets"))
    panel["targets"][0]["expr"] = expr
    problems = dashboard_problems(dashboard, exported, "deepinfer-prometheus")
    assert any(expected in p for p in problems), problems
    panel["datasource"] = {"type": "prometheus", "uid": "other"}
    assert any(
        "is not the provisioned" in p for p in dashboard_problems(dashboard, exported, "deepinfer-prometheus")
    )
