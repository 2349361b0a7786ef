"""OpenTelemetry traces of a request across services, sent when an exporter is configured.

``--otel-endpoint URL`` (or ``OTEL_EXPORTER_OTLP_ENDPOINT``) on the gateway and the scheduler sends
their spans over OTLP/HTTP to ``URL/v1/traces`` (an OpenTelemetry collector, Jaeger, Tempo). Without
it every span is the API's no-op and costs next to nothing. One request is one trace:

- gateway: ``POST /v1/chat/completions`` (any generation route): from arrival to the end of the
  response, streaming included;
- scheduler, its child through the submit's W3C ``traceparent`` (``SubmitRequest.traceparent``):
  ``scheduler.place`` (hashing the prompt, the KV lookup, picking the worker) and
  ``scheduler.queue`` (placed on a worker until its first admission into a plan).

Workers run steps of many requests at once: they add no per-request spans (a step's time is in the
scheduler's metrics). The SDK and the exporter are the ``otel`` extra (``pip install
'deepinfer[otel]'``); asking for an endpoint without them fails at start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from opentelemetry import context, trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

OTEL_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
_PROPAGATOR = TraceContextTextMapPropagator()


def tracer() -> trace.Tracer:
    """deepinfer's tracer: a no-op until ``setup_tracing`` installed an exporter."""
    return trace.get_tracer("deepinfer")


def otel_endpoint(configured: str, env: Mapping[str, str] = os.environ) -> str:
    return configured or env.get(OTEL_ENDPOINT_ENV, "")


def setup_tracing(service: str, endpoint: str) -> None:
    """Send this process's spans to ``endpoint`` (OTLP/HTTP); nothing when it is ""."""
    if not endpoint:
        return
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        why = f"otel_endpoint needs the otel extra: pip install 'deepinfer[otel]' ({exc})"
        raise ValueError(why) from exc
    provider = TracerProvider(resource=Resource.create({"service.name": f"deepinfer-{service}"}))
    exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")
    # Short batches: a stopping process flushes at exit, and a trace shows up within a second.
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    log.info("traces go to %s", endpoint)


def shutdown_tracing() -> None:
    """Flush the spans still batched (a stopping service)."""
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()


def current_traceparent() -> str:
    """The W3C ``traceparent`` of the current span ("" when none is recording)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent", "")


def parent_context(traceparent: str) -> context.Context | None:
    """The context a ``traceparent`` names (None for ""): the parent of a span in another service."""
    return _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None
