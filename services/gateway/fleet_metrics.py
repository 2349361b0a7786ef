"""What the gateway's /metrics reports of the fleet: every service's latest KV-cache stats and the
KV router's decisions, as Prometheus families read at scrape time.

KV-cache stats: schedulers, workers and kvcache services each publish a ``KVCacheStats`` now and
then on ``stats.<kind>.<id>``. A ``StatsBoard`` keeps the latest per (kind, publisher) and drops a
publisher silent for ``STALE_AFTER_S`` (it stopped, or lost its connection): its last numbers would
otherwise be scraped forever as if current. Times come in as ``now`` (monotonic seconds). Every
counter becomes ``deepinfer_kv_<name>{kind, publisher, label} value``: whether it is a counter or a
gauge is its publisher's business, so these families are untyped. Derived from the schedulers'
counters, summed over them:

    deepinfer_kv_hit_rate{tier=T} = sum hit_tokens{label=T} / sum query_tokens

where a scheduler's query tokens for T are its ``query_tokens{label=T}`` if it counts them per tier,
else its total (label "all", "total" or ""). A tier with no query tokens yet has no rate (not 0,
not NaN).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, UnknownMetricFamily

from libs.protocol.kv_messages import KVCacheStats

if TYPE_CHECKING:
    from services.gateway.routing import RouterFeed

STALE_AFTER_S: Final = 60.0
KV_PREFIX: Final = "deepinfer_kv_"
HIT_RATE: Final = KV_PREFIX + "hit_rate"
TOTAL_LABELS: Final = ("all", "total", "")  # how publishers label a counter not split by tier
_NOT_IN_NAME: Final = re.compile(r"[^a-zA-Z0-9_]")


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


def metric_name(name: str) -> str:
    """A publisher's counter name as a legal metric name part (anything else becomes '_')."""
    return _NOT_IN_NAME.sub("_", name) or "_"


def kv_families(stats: Sequence[KVCacheStats]) -> list[Metric]:
    """Every counter of ``stats`` (untyped, each family's series in the order first seen; a series
    given twice keeps its last value, as a scrape with a duplicate fails whole), then the hit rates."""
    series: dict[str, dict[tuple[str, str, str], float]] = {}
    for one in stats:
        for c in one.counters:
            by_labels = series.setdefault(KV_PREFIX + metric_name(c.name), {})
            by_labels[(one.kind, one.publisher_id, c.label)] = c.value
    families: list[Metric] = []
    doc = "a KV-cache stat as its publishers report it"
    for name, values in series.items():
        family = UnknownMetricFamily(name, doc, labels=["kind", "publisher", "label"])
        for labels, value in values.items():
            family.add_metric(list(labels), value)
        families.append(family)
    rates = hit_rates(stats)
    if rates:
        doc = "prompt tokens found cached in a tier / prompt tokens looked up, over every scheduler"
        hit_rate = GaugeMetricFamily(HIT_RATE, doc, labels=["tier"])
        for tier, rate in rates.items():
            hit_rate.add_metric([tier], rate)
        families.append(hit_rate)
    return families


def router_families(feed: RouterFeed) -> Iterator[Metric]:
    """The KV router's decisions: where it sent requests, how much of their prompts it found
    cached there (their ratio is the hit rate it routed for), and its resyncs."""
    stats = feed.router.stats
    routes = CounterMetricFamily(
        "deepinfer_router_routes", "requests the KV router sent to each worker", labels=["worker_id"]
    )
    for worker_id, count in sorted(stats.num_routes.items()):
        routes.add_metric([worker_id], count)
    yield routes
    doc = "over routed requests: prompt blocks their worker held in G1 or G2 when routed"
    yield CounterMetricFamily("deepinfer_router_cached_blocks", doc, value=stats.num_cached_blocks)
    doc = "over routed requests: prompt blocks a cache hit could skip"
    yield CounterMetricFamily("deepinfer_router_prompt_blocks", doc, value=stats.num_prompt_blocks)
    doc = "requests with no worker to name (none known, live, owned and decoding): any scheduler placed them"
    yield CounterMetricFamily("deepinfer_router_unrouted", doc, value=stats.num_unrouted)
    doc = "KV dumps asked of a publisher after a gap in its event stream, by outcome"
    dumps = CounterMetricFamily("deepinfer_router_dumps", doc, labels=["outcome"])
    for outcome, count in feed.num_dumps.items():
        dumps.add_metric([outcome], count)
    yield dumps
