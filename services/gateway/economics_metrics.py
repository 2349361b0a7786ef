"""The serving economics in /metrics: the usage each generation served, counted once when it
ends (``ServedUsage``), and the Prometheus families read from it at scrape time (economics.py)."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from libs.protocol.stream_messages import StreamRecord
from libs.recipe.segments import Usage
from services.gateway.economics import (
    TOKEN_KINDS,
    DeviceClock,
    PriceList,
    TokenLedger,
    gross_margin,
    revenue_per_device_hour,
)

if TYPE_CHECKING:
    from services.gateway.generation import GenerationObserver


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


class ServedUsage:
    """Every generation's usage, counted once per request id when it ends without error (a
    background Responses request, a stream finished on a resume, and a replay of a finished
    stream all end a generation): the economics' ledger and, with API keys, each tenant's tokens.
    Remembers the last ``MAX_COUNTED`` request ids it counted."""

    MAX_COUNTED = 1 << 16

    def __init__(self, ledger: TokenLedger, tenant_tokens: PromCounter | None) -> None:
        self.ledger = ledger
        self.tenant_tokens = tenant_tokens
        self._counted: OrderedDict[str, None] = OrderedDict()

    def ended(self, record: StreamRecord, usage: Usage, error: str) -> None:
        if error or record.request_id in self._counted:
            return
        self._counted[record.request_id] = None
        if len(self._counted) > self.MAX_COUNTED:
            self._counted.popitem(last=False)
        counts = (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
        self.ledger.add(*counts)
        if self.tenant_tokens is not None and record.tenant:
            for kind, count in TokenLedger.split(*counts):
                self.tenant_tokens.labels(record.tenant, kind).inc(count)


class UsageObserver:
    """A generation's observer that counts its usage in ``ServedUsage`` when it ends, then tells
    the request's own observer (``inner``: its latency metrics), if it has one."""

    def __init__(self, served: ServedUsage, record: StreamRecord, inner: GenerationObserver | None) -> None:
        self.served = served
        self.record = record
        self.inner = inner

    def tokens(self, index: int) -> None:
        if self.inner is not None:
            self.inner.tokens(index)

    def ended_with(self, usage: Usage, error: str) -> None:
        self.served.ended(self.record, usage, error)
        if self.inner is not None:
            self.inner.ended_with(usage, error)
