"""Checks the compose stack's monitoring profile: Prometheus scrapes every service that serves
/metrics, on the port it serves it on, and Grafana is provisioned with that Prometheus and the
dashboard (the dashboard's queries are ``metric_names``' to check).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from deepinfer.cli import SERVICES
from libs.runtime.settings import build_config
from tests.unit.compose.compose_file import (
    COMPOSE_DIR,
    DASHBOARD_FILE,
    GRAFANA_DIR,
    PROMETHEUS_FILE,
    environment,
    parse_args,
    string_list,
    volume_mounts,
)

PROFILE = "monitoring"
PROMETHEUS_PORT = 9090  # its default --web.listen-address


def metrics_port(service: dict[str, Any]) -> int | None:
    """The port a deepinfer service serves /metrics on (the gateway: its HTTP port); None: none."""
    command = string_list(service.get("command")) if "build" in service else None
    args = parse_args(command)[0] if command else None
    if args is None or args.command not in SERVICES:
        return None
    config: Any = build_config(SERVICES[args.command][1], args, environment(service))
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
        (COMPOSE_DIR / s).resolve() == source.resolve() and t == target for s, t in volume_mounts(service)
    )


def prometheus_problems(compose: dict[str, Any], conf: dict[str, Any]) -> list[str]:
    services = compose.get("services", {})
    prometheus = services.get("prometheus")
    if not isinstance(prometheus, dict):
        return ["no 'prometheus' service"]
    problems = _pinned("prometheus", prometheus)
    if prometheus.get("profiles") != [PROFILE]:
        problems.append(f"prometheus: not in (only) the {PROFILE!r} profile")
    argv = string_list(prometheus.get("command") or []) or []
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
    home = environment(grafana).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH", "")
    if home != target:
        problems.append(f"grafana: the home dashboard {home!r} is not {target!r}")
    return problems, str(sources[0].get("uid", "")) if len(sources) == 1 else ""
