"""Every Prometheus metric of the kvcache process, served on ``--metrics-port`` (0: not served).

Read at scrape time from the service (``KVCacheService.stats()``, what it also publishes to the
gateways, and its index) by ``KVCacheCollector``:

- ``deepinfer_kvcache_index_blocks``: blocks in the index (the G3 store as the index sees it)
- ``deepinfer_kvcache_stored_blocks{retention_class}``, ``deepinfer_kvcache_stored_bytes{...}``
- ``deepinfer_kvcache_evicted_blocks_total{reason}``: blocks removed from the store, by why
- ``deepinfer_kvcache_lookups_total``, ``deepinfer_kvcache_lookup_hit_blocks_total``: G3 lookups
  of the schedulers' submits, and the leading blocks they found stored
- ``deepinfer_kvcache_resyncs_total``: full passes asked for by a gap in a worker's KV events
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Final, NamedTuple

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from services.kvcache.service import KVCacheService


class Spec(NamedTuple):
    counter: bool  # else a gauge
    metric: str
    label: str | None  # the name of the stat's label, or None: the stat has one value
    doc: str

    def family(self) -> GaugeMetricFamily | CounterMetricFamily:
        labels = [] if self.label is None else [self.label]
        kind = CounterMetricFamily if self.counter else GaugeMetricFamily
        return kind(self.metric, self.doc, labels=labels)


# stats() counter name -> its metric. A gauge's "total" label is left out (the sum over classes);
# a stat not named here is published to the gateways only.
SPECS: Final = {
    "stored_blocks": Spec(False, "deepinfer_kvcache_stored_blocks", "retention_class", "stored blocks"),
    "stored_bytes": Spec(False, "deepinfer_kvcache_stored_bytes", "retention_class", "stored bytes"),
    "evicted_blocks": Spec(
        True, "deepinfer_kvcache_evicted_blocks", "reason", "blocks removed from the store"
    ),
    "lookups": Spec(True, "deepinfer_kvcache_lookups", None, "G3 lookups answered"),
    "lookup_hit_blocks": Spec(
        True, "deepinfer_kvcache_lookup_hit_blocks", None, "leading blocks found stored"
    ),
    "resyncs": Spec(True, "deepinfer_kvcache_resyncs", None, "full passes asked for by a gap in KV events"),
}


class KVCacheCollector(Collector):
    """The service's index and stats, read when scraped (from the server's thread: the stats copy
    the index's totals, and a GC pass in a thread job at that moment is seen half done at worst)."""

    def __init__(self, service: KVCacheService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        doc = "blocks in the index of the shared store"
        yield GaugeMetricFamily("deepinfer_kvcache_index_blocks", doc, value=len(self.service.index))
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for stat in self.service.stats().counters:
            spec = SPECS.get(stat.name)
            if spec is None or (not spec.counter and stat.label == "total"):
                continue
            if spec.metric not in families:
                families[spec.metric] = spec.family()
            families[spec.metric].add_metric([] if spec.label is None else [stat.label], stat.value)
        yield from families.values()


def registry(service: KVCacheService) -> CollectorRegistry:
    """What /metrics shows: the process and ``service``'s index and stats."""
    view = CollectorRegistry()
    ProcessCollector(registry=view)
    view.register(KVCacheCollector(service))
    return view
