"""Every Prometheus metric of the encoder process, served on ``--metrics-port`` (0: not served).

- ``deepinfer_encoder_images_total``: images run through the vision tower
- ``deepinfer_encoder_seconds_total``: the time those forwards took
- ``deepinfer_encoder_cache_hits_total`` / ``..._misses_total``: requested images found cached, or not
- ``deepinfer_encoder_cache_bytes``, ``deepinfer_encoder_cache_entries``: what the cache holds
- ``deepinfer_encoder_cache_evicted_total``: outputs evicted to stay within the budget
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from services.encoder.service import EncoderService


class EncoderCollector(Collector):
    """The service's counters and its cache, read when scraped (from the server's thread: each
    is one int or float, written by the encode thread)."""

    def __init__(self, service: EncoderService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        service, cache = self.service, self.service.cache
        yield CounterMetricFamily(
            "deepinfer_encoder_images", "images run through the vision tower", value=service.num_encoded
        )
        yield CounterMetricFamily(
            "deepinfer_encoder_seconds", "time of the vision tower's forwards", value=service.encode_s
        )
        yield CounterMetricFamily(
            "deepinfer_encoder_cache_hits",
            "requested images found in the encoder cache",
            value=cache.num_hits,
        )
        yield CounterMetricFamily(
            "deepinfer_encoder_cache_misses",
            "requested images not in the encoder cache",
            value=cache.num_misses,
        )
        yield CounterMetricFamily(
            "deepinfer_encoder_cache_evicted",
            "outputs evicted to stay within the budget",
            value=cache.num_evicted,
        )
        yield GaugeMetricFamily(
            "deepinfer_encoder_cache_bytes", "bytes of the cached outputs", value=cache.num_bytes
        )
        yield GaugeMetricFamily("deepinfer_encoder_cache_entries", "cached outputs", value=len(cache))


def registry(service: EncoderService) -> CollectorRegistry:
    """What /metrics shows: the process and ``service``'s encodes and cache."""
    view = CollectorRegistry()
    ProcessCollector(registry=view)
    view.register(EncoderCollector(service))
    return view
