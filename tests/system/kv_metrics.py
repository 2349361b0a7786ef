"""The schedulers' KV-cache counters as the gateway's /metrics shows them (``deepinfer_kv_*``)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scheduler_kv_stat(root_url: str, name: str, label: str, scheduler_id: str = "") -> float:
    """``deepinfer_kv_<name>{kind="scheduler", label=<label>}`` summed over every scheduler, or
    that of ``scheduler_id`` alone (0 before any has published it)."""
    text = httpx.get(f"{root_url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == f"deepinfer_kv_{name}"
        for sample in family.samples
        if sample.labels.get("kind") == "scheduler"
        and sample.labels.get("label") == label
        and (not scheduler_id or sample.labels.get("publisher") == scheduler_id)
    )
