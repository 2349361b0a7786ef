"""The serving economics as Prometheus families, read at scrape time (see economics.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.gateway.economics import (
    TOKEN_KINDS,
    DeviceClock,
    PriceList,
    TokenLedger,
    gross_margin,
    revenue_per_device_hour,
)


def economics_families(ledger: TokenLedger, clock: DeviceClock, prices: PriceList) -> Iterator[Metric]:
    revenue = ledger.revenue(prices)
    doc = "revenue of the generations this gateway served, at the price list, by token kind"
    dollars = CounterMetricFamily("deepinfer_revenue_dollars", doc, labels=["kind"])
    for kind in TOKEN_KINDS:
        dollars.add_metric([kind], revenue[kind])
    yield dollars
    doc = "wall time workers were live (what a rental pays for), by device kind, as this gateway saw them"
    device_seconds = CounterMetricFamily("deepinfer_device_seconds", doc, labels=["device"])
    for device, seconds in sorted(clock.seconds.items()):
        device_seconds.add_metric([device], seconds)
    yield device_seconds
    workers = GaugeMetricFamily("deepinfer_workers", "live workers, by device kind", labels=["device"])
    for device, count in sorted(Counter(clock.live.values()).items()):
        workers.add_metric([device], count)
    yield workers
    doc = "the price list: dollars per million tokens, by token kind"
    price = GaugeMetricFamily("deepinfer_price_per_million_tokens_dollars", doc, labels=["kind"])
    for kind in TOKEN_KINDS:
        price.add_metric([kind], prices.per_token(kind) * 1e6)
    yield price
    name, rental = "deepinfer_rental_per_device_hour_dollars", prices.rental_per_device_hour
    yield GaugeMetricFamily(name, "the rental of one device for an hour", value=rental)
    per_hour = revenue_per_device_hour(sum(revenue.values()), sum(clock.seconds.values()))
    if per_hour is not None:
        doc = "revenue / device hours, since this gateway started"
        yield GaugeMetricFamily("deepinfer_revenue_per_device_hour_dollars", doc, value=per_hour)
    margin = gross_margin(per_hour, prices.rental_per_device_hour)
    if margin is not None:
        doc = "1 - rental / revenue per device-hour, since this gateway started"
        yield GaugeMetricFamily("deepinfer_gross_margin_ratio", doc, value=margin)
