"""The gateway's /metrics: every service's latest KV-cache stats, and what this gateway measures of
the requests it serves. Exposition is prometheus_client's (one registry per app).

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

Requests (``POST`` to a generation route; resumes, retrievals and count_tokens are not requests):
``RequestMetrics`` (ASGI middleware) times each from its arrival and counts it by api and outcome
once its response ended; the ``Generation`` serving it reports each delta with tokens and its end
to the request's ``RequestObserver``. A background Responses request is counted when its queued
object is answered; its generation runs on after the request, unmeasured.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, UnknownMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from libs.protocol.kv_messages import KVCacheStats
from libs.recipe.segments import Usage
from services.gateway.economics import PriceList, TokenLedger
from services.gateway.economics_metrics import ServedUsage, economics_families

if TYPE_CHECKING:
    from services.gateway.routing import RouterFeed
    from services.gateway.service import GatewayService

disable_created_metrics()  # type: ignore[no-untyped-call]  # no ``*_created`` series beside each counter

STALE_AFTER_S: Final = 60.0
KV_PREFIX: Final = "deepinfer_kv_"
HIT_RATE: Final = KV_PREFIX + "hit_rate"
TOTAL_LABELS: Final = ("all", "total", "")  # how publishers label a counter not split by tier
_NOT_IN_NAME: Final = re.compile(r"[^a-zA-Z0-9_]")

# The generation routes, by path (POST only): the ``api`` label.
API_OF_PATH: Final = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}
_OBSERVER_KEY: Final = "deepinfer.request_observer"  # in the ASGI scope's "state"

# Buckets in seconds (vLLM's, with finer steps at the fast end for small models).
TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
ITL_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS: Final = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip


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


class GatewayCollector(Collector):
    """Read at scrape time: the KV-cache stats board, and the requests this gateway has pending."""

    def __init__(
        self,
        service: GatewayService,
        ledger: TokenLedger,
        prices: PriceList,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.service = service
        self.ledger = ledger
        self.prices = prices
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        yield from kv_families(self.service.kv_stats.current(self.clock()))
        self.service.observe_devices()
        yield from economics_families(self.ledger, self.service.device_clock, self.prices)
        doc = "requests submitted by this gateway and not yet over (background ones included)"
        pending = GaugeMetricFamily("deepinfer_gateway_requests_in_flight", doc, labels=["gateway"])
        pending.add_metric([self.service.gateway_id], self.service.num_in_flight)
        yield pending
        doc = "requests whose scheduler was lost, by outcome: moved (resubmitted elsewhere) or failed"
        moves = CounterMetricFamily("deepinfer_gateway_scheduler_moves", doc, labels=["outcome"])
        for name, count in self.service.migrations.num_moves.items():
            moves.add_metric([name], count)
        yield moves
        if self.service.router is not None:
            yield from router_families(self.service.router)


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


class GatewayMetrics:
    """Every metric of one gateway app, on a registry of its own (several apps share a test process)."""

    def __init__(
        self, service: GatewayService, prices: PriceList | None = None, per_tenant: bool = False
    ) -> None:
        """``per_tenant``: count tokens by tenant (API keys are on: tenants are the keys file's)."""
        self.registry = registry = CollectorRegistry()
        self.ledger = TokenLedger()  # every generation's tokens by kind: the economics' revenue
        api = ["api"]
        self.requests = Counter(
            "deepinfer_requests",
            "generation requests by api and outcome: ok, client_error (4xx), queue_full (429), "
            "rate_limited (429: the API key's limit), unavailable (503), server_error, cancelled "
            "(the client left first)",
            ["api", "outcome"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "deepinfer_requests_in_flight",
            "generation requests whose response is not over",
            api,
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "deepinfer_time_to_first_token_seconds",
            "from a request's arrival to its first delta with tokens",
            api,
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "deepinfer_inter_token_latency_seconds",
            "between a choice's consecutive deltas with tokens",
            api,
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e_request_latency = Histogram(
            "deepinfer_e2e_request_latency_seconds",
            "from a request's arrival to the end of its response, for the requests that ended ok",
            api,
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "deepinfer_prompt_tokens", "prompt tokens of the generations that ended", api, registry=registry
        )
        self.cached_prompt_tokens = Counter(
            "deepinfer_cached_prompt_tokens",
            "of those prompt tokens, the ones served from a KV cache",
            api,
            registry=registry,
        )
        self.generation_tokens = Counter(
            "deepinfer_generation_tokens",
            "output tokens of the generations that ended",
            api,
            registry=registry,
        )
        self.tenant_tokens = Counter(
            "deepinfer_tenant_tokens",
            "tokens of the generations that ended, by API-key tenant (with --api-keys-file) and kind: "
            "input_uncached, input_cached (served from a KV cache), output",
            ["tenant", "kind"],
            registry=registry,
        )
        self.tenant_rate_limited = Counter(
            "deepinfer_tenant_rate_limited",
            "requests refused (429) because their API key was past its rate limit, by tenant",
            ["tenant"],
            registry=registry,
        )
        registry.register(GatewayCollector(service, self.ledger, prices or PriceList()))
        self.served = ServedUsage(self.ledger, self.tenant_tokens if per_tenant else None)
        ProcessCollector(registry=registry)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def outcome(
    status: int, raised: BaseException | None, error: bool, abandoned: bool, rate_limited: bool = False
) -> str:
    """A request's outcome: ``status`` the HTTP status sent (0: none), ``raised`` what the app
    raised, ``error`` its generation ended in error, ``abandoned`` its generation never ended,
    ``rate_limited`` its API key was past its limit (a 429 of its own, not the queue's)."""
    if isinstance(raised, asyncio.CancelledError | ClientDisconnect | OSError):
        return "cancelled"
    if raised is not None or (status >= 500 and status != 503):
        return "server_error"
    if status in (0, 499):  # nothing sent, or the non-streaming client left first
        return "cancelled"
    if status == 429:
        return "rate_limited" if rate_limited else "queue_full"
    if status == 503:
        return "unavailable"
    if status >= 400:
        return "client_error"
    if error:
        return "server_error"
    return "cancelled" if abandoned else "ok"


class RequestObserver:
    """One request's measurements, from its arrival (made by ``RequestMetrics``)."""

    def __init__(
        self, metrics: GatewayMetrics, api: str, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.metrics = metrics
        self.api = api
        self.clock = clock
        self.arrival = clock()
        self.generating = False  # a generation answers it: it is over when that has ended
        self.ended = False
        self.error = False
        self._rate_limited = False
        self._last_tokens: dict[int, float] = {}  # choice -> when its last delta with tokens came

    def tokens(self, index: int) -> None:
        """A delta with tokens of choice ``index`` came: the first of the request is its TTFT."""
        now = self.clock()
        if not self._last_tokens:
            self.metrics.time_to_first_token.labels(self.api).observe(now - self.arrival)
        elif index in self._last_tokens:
            self.metrics.inter_token_latency.labels(self.api).observe(now - self._last_tokens[index])
        self._last_tokens[index] = now

    def ended_with(self, usage: Usage, error: str) -> None:
        """The generation ended: count its tokens (as its usage reports them)."""
        self.ended, self.error = True, bool(error)
        self.metrics.prompt_tokens.labels(self.api).inc(usage.prompt_tokens)
        self.metrics.cached_prompt_tokens.labels(self.api).inc(usage.cached_tokens)
        self.metrics.generation_tokens.labels(self.api).inc(usage.completion_tokens)

    def rate_limited(self, tenant: str) -> None:
        """The request's key was past its rate limit: it is refused with a 429."""
        self._rate_limited = True
        self.metrics.tenant_rate_limited.labels(tenant).inc()

    def finish(self, status: int, raised: BaseException | None) -> None:
        """The response is over."""
        result = outcome(status, raised, self.error, self.generating and not self.ended, self._rate_limited)
        self.metrics.requests.labels(self.api, result).inc()
        if result == "ok":
            self.metrics.e2e_request_latency.labels(self.api).observe(self.clock() - self.arrival)


def observer_of(scope: Scope) -> RequestObserver | None:
    """The request's observer (None when the route is not measured)."""
    observer = scope.get("state", {}).get(_OBSERVER_KEY)
    return observer if isinstance(observer, RequestObserver) else None


def watch_generation(request: Request) -> RequestObserver | None:
    """The request's observer (None when the route is not measured), now waiting for the end of
    the generation that answers it."""
    observer = observer_of(request.scope)
    if observer is not None:
        observer.generating = True
    return observer


class RequestMetrics:
    """ASGI middleware: each generation request counted by api and outcome, timed, kept in flight."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        measured = scope["type"] == "http" and scope["method"] == "POST"
        api = API_OF_PATH.get(scope["path"]) if measured else None
        if api is None:
            await self.app(scope, receive, send)
            return
        observer = RequestObserver(self.metrics, api)
        scope.setdefault("state", {})[_OBSERVER_KEY] = observer
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        raised: BaseException | None = None
        in_flight = self.metrics.in_flight.labels(api)
        in_flight.inc()
        try:
            await self.app(scope, receive, sending)
        except BaseException as exc:
            raised = exc
            raise
        finally:
            in_flight.dec()
            observer.finish(status, raised)
