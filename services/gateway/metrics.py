"""The gateway's /metrics: what this gateway measures of the requests it serves, with the fleet's
KV-cache stats and router decisions (fleet_metrics.py) and the serving economics
(economics_metrics.py) read at scrape time. Exposition is prometheus_client's (one registry per app).

Requests (``POST`` to a generation route; resumes, retrievals and count_tokens are not requests):
``RequestMetrics`` (ASGI middleware) times each from its arrival and counts it by api and outcome
once its response ended; the ``Generation`` serving it reports each delta with tokens and its end
to the request's ``RequestObserver``. A background Responses request is counted when its queued
object is answered; its generation runs on after the request, unmeasured.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Final

from opentelemetry.trace import SpanKind
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from libs.recipe.segments import Usage
from libs.runtime.tracing import tracer
from services.gateway.economics import PriceList, TokenLedger
from services.gateway.economics_metrics import ServedUsage, economics_families
from services.gateway.fleet_metrics import kv_families, router_families

if TYPE_CHECKING:
    from services.gateway.service import GatewayService

disable_created_metrics()  # type: ignore[no-untyped-call]  # no ``*_created`` series beside each counter

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


class GatewayMetrics:
    """Every metric of one gateway app, on a registry of its own (several apps share a test process)."""

    def __init__(
        self, service: GatewayService, prices: PriceList | None = None, per_tenant: bool = False
    ) -> None:
        """``per_tenant``: count tokens by tenant (API keys are on: tenants are the keys file's)."""
        self.registry = registry = CollectorRegistry()
        self.ledger = TokenLedger()  # every generation's tokens by kind: the economics' revenue
        self._latency_metrics(registry)
        self._token_metrics(registry)
        registry.register(GatewayCollector(service, self.ledger, prices or PriceList()))
        self.served = ServedUsage(self.ledger, self.tenant_tokens if per_tenant else None)
        ProcessCollector(registry=registry)

    def _latency_metrics(self, registry: CollectorRegistry) -> None:
        api = ["api"]
        self.requests = Counter(
            "deepinfer_requests",
            "generation requests by api and outcome: ok, client_error (4xx), queue_full (429), "
            "rate_limited (429: the API key's limit), unavailable (503), server_error, cancelled "
            "(the client left first)",
            ["api", "outcome"],
            registry=registry,
        )
        doc = "generation requests whose response is not over"
        self.in_flight = Gauge("deepinfer_requests_in_flight", doc, api, registry=registry)
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

    def _token_metrics(self, registry: CollectorRegistry) -> None:
        api = ["api"]
        doc = "prompt tokens of the generations that ended"
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", doc, api, registry=registry)
        doc = "of those prompt tokens, the ones served from a KV cache"
        self.cached_prompt_tokens = Counter("deepinfer_cached_prompt_tokens", doc, api, registry=registry)
        doc = "output tokens of the generations that ended"
        self.generation_tokens = Counter("deepinfer_generation_tokens", doc, api, registry=registry)
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
        # The request's trace (libs/runtime/tracing.py; a no-op span without an exporter)
        name, attributes = f"POST {scope['path']}", {"deepinfer.api": api}
        with tracer().start_as_current_span(name, kind=SpanKind.SERVER, attributes=attributes) as span:
            try:
                await self.app(scope, receive, sending)
            except BaseException as exc:
                raised = exc
                raise
            finally:
                in_flight.dec()
                observer.finish(status, raised)
                span.set_attribute("http.response.status_code", status)
