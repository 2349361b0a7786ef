"""/metrics: every service's latest KV-cache stats and the gateway's own gauges, as Prometheus text. Pure.

Schedulers, workers and kvcache services each publish a ``KVCacheStats`` now and then on
``stats.<kind>.<id>``. A ``StatsBoard`` keeps the latest per (kind, publisher) and drops a
publisher silent for ``STALE_AFTER_S`` (it stopped, or lost its connection): its last numbers would
otherwise be scraped forever as if current. Times come in as ``now`` (monotonic seconds).

Every counter becomes ``deepinfer_kv_<name>{kind, publisher, label} value``: whether it is a
counter or a gauge is its publisher's business, so these families are ``untyped``. Derived from the
schedulers' counters, summed over them:

    deepinfer_kv_hit_rate{tier=T} = sum hit_tokens{label=T} / sum query_tokens

where a scheduler's query tokens for T are its ``query_tokens{label=T}`` if it counts them per tier,
else its total (label "all", "total" or ""). A tier with no query tokens yet has no rate (not 0,
not NaN).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from libs.protocol.kv_messages import KVCacheStats

STALE_AFTER_S: Final = 60.0
KV_PREFIX: Final = "deepinfer_kv_"
HIT_RATE: Final = KV_PREFIX + "hit_rate"
TOTAL_LABELS: Final = ("all", "total", "")  # how publishers label a counter not split by tier
_NOT_IN_NAME: Final = re.compile(r"[^a-zA-Z0-9_]")

MetricType = Literal["untyped", "gauge", "counter"]


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float
    type: MetricType = "gauge"


class StatsBoard:
    """The latest KVCacheStats of each live publisher."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S) -> None:
        self.stale_after_s = stale_after_s
        self._latest: dict[tuple[str, str], tuple[float, KVCacheStats]] = {}

    def update(self, stats: KVCacheStats, now: float) -> None:
        self._latest[(stats.kind, stats.publisher_id)] = (now, stats)

    def current(self, now: float) -> list[KVCacheStats]:
        """The live publishers' stats, by kind then publisher; the stale ones are forgotten."""
        for key in [k for k, (seen, _) in self._latest.items() if now - seen > self.stale_after_s]:
            del self._latest[key]
        return [stats for _, (_, stats) in sorted(self._latest.items())]


def hit_rates(stats: Iterable[KVCacheStats]) -> dict[str, float]:
    """Tier -> hit tokens / query tokens over every scheduler (tiers with no queries left out).
    A scheduler with no hits in a tier still counts its queries there: they missed it."""
    per_scheduler = [
        (
            {c.label: c.value for c in one.counters if c.name == "hit_tokens"},
            {c.label: c.value for c in one.counters if c.name == "query_tokens"},
        )
        for one in stats
        if one.kind == "scheduler"
    ]
    tiers = sorted({tier for hits, _ in per_scheduler for tier in hits})
    rates: dict[str, float] = {}
    for tier in tiers:
        hit = sum(hits.get(tier, 0.0) for hits, _ in per_scheduler)
        query = sum(queries[tier] if tier in queries else _total(queries) for _, queries in per_scheduler)
        if query > 0:
            rates[tier] = hit / query
    return rates


def _total(by_label: dict[str, float]) -> float:
    return next((by_label[label] for label in TOTAL_LABELS if label in by_label), 0.0)


def kv_samples(stats: Sequence[KVCacheStats]) -> list[Sample]:
    """Every counter of ``stats`` as a sample, then the derived hit rates."""
    samples = [
        Sample(
            KV_PREFIX + metric_name(c.name),
            (("kind", one.kind), ("publisher", one.publisher_id), ("label", c.label)),
            c.value,
            "untyped",
        )
        for one in stats
        for c in one.counters
    ]
    samples += [Sample(HIT_RATE, (("tier", tier),), rate) for tier, rate in hit_rates(stats).items()]
    return samples


def render(samples: Iterable[Sample]) -> str:
    """Prometheus' text format (0.0.4): each family's samples together under one TYPE line, in the
    order first seen; a series given twice keeps its last value (a scrape with one fails whole)."""
    families: dict[str, tuple[MetricType, dict[tuple[tuple[str, str], ...], float]]] = {}
    for sample in samples:
        _, series = families.setdefault(sample.name, (sample.type, {}))
        series[sample.labels] = sample.value
    lines: list[str] = []
    for name, (type_, series) in families.items():
        lines.append(f"# TYPE {name} {type_}")
        for labels, value in series.items():
            lines.append(f"{name}{_labels(labels)} {_value(value)}")
    return "".join(line + "\n" for line in lines)


def metric_name(name: str) -> str:
    """A publisher's counter name as a legal metric name part (anything else becomes '_')."""
    return _NOT_IN_NAME.sub("_", name) or "_"


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    escaped = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in labels)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(labels, escaped, strict=True)) + "}"


def _value(value: float) -> str:
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)
