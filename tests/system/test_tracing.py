"""OpenTelemetry traces across services: ``deepinfer serve --otel-endpoint`` sends the gateway's and
the scheduler's spans over OTLP/HTTP to a receiver in this test (it decodes them with the OTLP
protobuf schema); one chat completion is one trace, the scheduler's spans children of the gateway's."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from libs.bus.nats_server import free_port
from tests.system.serve_proc import MODEL, Serve, serving

READY_S = 240.0
SPAN_NAMES = {"POST /v1/chat/completions", "scheduler.place", "scheduler.queue"}


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace endpoint: every span it is sent, as (service name, span)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", free_port()), _Handler)
        self.spans: list[tuple[str, Span]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest.FromString(body)
        receiver = self.server
        assert isinstance(receiver, Receiver) and self.path == "/v1/traces"
        with receiver.lock:
            for resource_spans in request.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    receiver.spans += [(attributes["service.name"], span) for span in scope_spans.spans]
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def attribute(span: Span, key: str) -> str:
    return str(next(a.value.string_value for a in span.attributes if a.key == key))


def test_one_request_is_one_trace_across_gateway_and_scheduler(
    receiver: Receiver, model_cache_dir: Path, tmp_path: Path
) -> None:
    with serving(model_cache_dir, tmp_path, "--otel-endpoint", receiver.url, ready_s=READY_S) as serve:
        request_id = chat(serve)
        deadline = time.monotonic() + 30
        while True:
            with receiver.lock:
                mine = [(svc, s) for svc, s in receiver.spans if request_id in _request_ids(s)]
            if {s.name for _, s in mine} >= {
                "POST /v1/chat/completions",
                "scheduler.place",
                "scheduler.queue",
            }:
                break
            assert time.monotonic() < deadline, [(svc, s.name) for svc, s in mine]
            time.sleep(0.5)
    by_name = {s.name: (svc, s) for svc, s in mine}
    service, root = by_name["POST /v1/chat/completions"]
    assert service == "deepinfer-gateway" and attribute(root, "deepinfer.api") == "chat"
    for name in ("scheduler.place", "scheduler.queue"):
        service, span = by_name[name]
        assert service == "deepinfer-scheduler"
        assert span.trace_id == root.trace_id and span.parent_span_id == root.span_id, name
        # inside the request's time
        assert root.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano
        assert span.end_time_unix_nano <= root.end_time_unix_nano
    place = by_name["scheduler.place"][1]
    assert attribute(place, "deepinfer.submit_status") == "accepted"


def _request_ids(span: Span) -> set[str]:
    return {a.value.string_value for a in span.attributes if a.key == "deepinfer.request_id"}


def chat(serve: Serve) -> str:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Say hi."}]}
    resp = httpx.post(f"{serve.url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["id"])
