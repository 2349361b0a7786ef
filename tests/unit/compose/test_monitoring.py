"""Tests of the compose stack's monitoring profile, as it is and deliberately broken.

Prometheus must scrape every service that serves /metrics, on its port; Grafana must be provisioned
with it and the dashboard; the dashboard must query only metrics the code exports (found by reading
the metrics modules, as they are, and collecting the registries that exist at import), and
docs/metrics.md list them all. Broken copies of each must be caught.
"""

from __future__ import annotations

import copy
import importlib
import re
from collections.abc import Callable
from typing import Any

import pytest

from tests.unit.compose.check_monitoring import grafana_problems, prometheus_problems
from tests.unit.compose.compose_file import (
    DATASOURCES_FILE,
    PROMETHEUS_FILE,
    PROVIDERS_FILE,
    REPO,
    load_compose,
    load_dashboard,
    load_yaml,
)
from tests.unit.compose.metric_names import (
    DYNAMIC,
    SUFFIXES,
    dashboard_panels,
    dashboard_problems,
    exported_metrics,
    promql_metrics,
)
from tests.unit.compose.mutations import ScrapeMutation, job

# ---------------------------------------------------------------- tests: the real files


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
    assert prometheus_problems(load_compose(), load_yaml(PROMETHEUS_FILE)) == []


def test_grafana_is_provisioned() -> None:
    problems, uid = grafana_problems(load_compose(), load_yaml(DATASOURCES_FILE), load_yaml(PROVIDERS_FILE))
    assert problems == [] and uid


def test_dashboard_queries_exported_metrics(exported: set[str]) -> None:
    uid = grafana_problems(load_compose(), load_yaml(DATASOURCES_FILE), load_yaml(PROVIDERS_FILE))[1]
    dashboard = load_dashboard()
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


SCRAPE_BREAKAGES: dict[str, tuple[ScrapeMutation, str]] = {
    "gateway port": (
        lambda c, p: job(p, "gateway").update(static_configs=[{"targets": ["gateway:8080"]}]),
        "gateway serves /metrics on port 8000",
    ),
    "worker port": (lambda c, p: job(p, "worker")["dns_sd_configs"][0].update(port=9200), "worker:9200"),
    "no kvcache job": (
        lambda c, p: p["scrape_configs"].remove(job(p, "kvcache")),
        "kvcache: serves /metrics on port 9100, which no scrape job reaches",
    ),
    "unknown host": (
        lambda c, p: job(p, "scheduler")["dns_sd_configs"][0].update(names=["schedulers"]),
        "schedulers is not a compose service",
    ),
    "metrics port off": (
        lambda c, p: c["services"]["scheduler"]["environment"].pop("DEEPINFER_METRICS_PORT"),
        "scheduler is not a compose service serving /metrics",
    ),
    "nats scraped": (
        lambda c, p: job(p, "gateway").update(static_configs=[{"targets": ["gateway:8000", "nats:8222"]}]),
        "nats is not a compose service serving /metrics",
    ),
    "config not mounted": (
        lambda c, p: c["services"]["prometheus"].update(volumes=["prometheus-data:/prometheus"]),
        "not mounted where --config.file reads",
    ),
    "latest": (lambda c, p: c["services"]["prometheus"].update(image="prom/prometheus"), "not pinned"),
    "no profile": (lambda c, p: c["services"]["prometheus"].pop("profiles"), "the 'monitoring' profile"),
    "path": (lambda c, p: job(p, "worker").update(metrics_path="/stats"), "not http /metrics"),
}


@pytest.mark.parametrize("case", sorted(SCRAPE_BREAKAGES))
def test_scrape_checker_catches(case: str) -> None:
    compose, conf = copy.deepcopy(load_compose()), load_yaml(PROMETHEUS_FILE)
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
    compose, datasources = copy.deepcopy(load_compose()), load_yaml(DATASOURCES_FILE)
    mutate, expected = GRAFANA_BREAKAGES[case]
    mutate(compose["services"]["grafana"], datasources)
    problems = grafana_problems(compose, datasources, load_yaml(PROVIDERS_FILE))[0]
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
    dashboard = load_dashboard()
    panel = next(p for p in dashboard["panels"] if p.get("targets"))
    panel["targets"][0]["expr"] = expr
    problems = dashboard_problems(dashboard, exported, "deepinfer-prometheus")
    assert any(expected in p for p in problems), problems
    panel["datasource"] = {"type": "prometheus", "uid": "other"}
    assert any(
        "is not the provisioned" in p for p in dashboard_problems(dashboard, exported, "deepinfer-prometheus")
    )
