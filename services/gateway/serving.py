"""Serving one generation over HTTP, whatever the API: as SSE with ids, as one body, or resumed.

Error bodies follow the API: OpenAI's ``{"error": {message, type, param, code}}`` or Anthropic's
``{"type": "error", "error": {type, message}}``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from libs.protocol.stream_messages import StreamRecord
from libs.recipe.fields import ApiError, shown
from libs.runtime.logs import set_request_id
from services.gateway.admission import Admitted
from services.gateway.economics_metrics import ServedUsage, UsageObserver
from services.gateway.generation import Generation, GenerationObserver, numbered
from services.gateway.metrics import watch_generation
from services.gateway.renderers import renderer_for
from services.gateway.request_stream import RequestStream
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService
from services.gateway.sse import EventStreamResponse, frame, until_disconnect

log = logging.getLogger(__name__)
Shape = Literal["openai", "anthropic"]
OnDone = Callable[[Generation], Awaitable[None]]
_ISSUED_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")  # uuid4 hex after a prefix, with room to spare
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
MAX_BODY_BYTES = 32 << 20  # a 1M-token prompt is ~4 MB of text; anything far past that is a mistake

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_response(err: ApiError, shape: Shape = "openai", retry_after_s: int = 1) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if err.status == 429 else None
    if shape == "anthropic":
        type_ = _ANTHROPIC_TYPES.get(err.status, "api_error")
        body: dict[str, Any] = {"type": "error", "error": {"type": type_, "message": err.message}}
        return JSONResponse(body, status_code=err.status, headers=headers)
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def shape_of(path: str) -> Shape:
    """Which API's error shape a path answers in."""
    return "anthropic" if path == "/v1/messages" or path.startswith("/v1/messages/") else "openai"


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's routing errors (no such route: 404, wrong method: 405) in the API's shape."""
    assert isinstance(exc, HTTPException)
    what = "route" if exc.status_code == 404 else "method for route"
    message = f"Unknown {what} {request.method} {shown(request.url.path)}: {exc.detail}"
    code = "not_found" if exc.status_code == 404 else None
    response = error_response(ApiError(exc.status_code, message, code=code), shape_of(request.url.path))
    response.headers.update(exc.headers or {})  # a 405's Allow
    return response


class LastResort:
    """ASGI middleware: an exception no route turned into an answer becomes a JSON 500 in the
    API's shape, logged with its traceback, on a connection that stays open (Starlette's own
    ``Exception`` handler re-raises after answering, and uvicorn then drops the connection). A
    500 here is a server bug still; a client's mistake is a 400 raised where its input is parsed.
    Once the response has started, nothing can be answered: the exception ends the connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if started:
                raise
            err = ApiError(500, "The server had an error processing the request.", type_="server_error")
            await error_response(err, shape_of(scope["path"]))(scope, receive, send)


async def json_body(request: Request) -> Any:
    message = f"the request body is over {MAX_BODY_BYTES >> 20} MiB"
    too_large = ApiError(413, message, code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
    return parse_json(b"".join(chunks))


def _non_finite(literal: str) -> Any:
    raise ValueError(f"{literal} is not a JSON number")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        raise ValueError(f"{literal[:40]} is out of range for a double")
    return value


def parse_json(raw: bytes) -> Any:
    """A request body as JSON, or a 400: not UTF-8, not JSON, NaN or Infinity (which JSON lacks,
    though Python reads them), a number past a double, nesting past the parser's recursion, and a
    lone surrogate escape such as ``"\\ud800"`` (no UTF-8 string holds it: every later encode of
    the value, even quoting it in an error message, would fail)."""
    try:
        value = json.loads(raw, parse_constant=_non_finite, parse_float=_finite_float)
        if _SURROGATE_ESCAPE.search(raw):  # rare: check the escapes made valid pairs
            json.dumps(value, ensure_ascii=False).encode()
    except RecursionError as exc:
        raise ApiError(400, "invalid JSON body: nested too deeply") from exc
    except UnicodeEncodeError as exc:
        raise ApiError(400, "invalid JSON body: a \\u escape is a lone UTF-16 surrogate") from exc
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors too
        raise ApiError(400, f"invalid JSON body: {exc}") from exc
    return value


def is_issued_id(value: str) -> bool:
    """Whether ``value`` could be an id this gateway issued (an API's prefix, then hex). Anything
    else is unknown without a lookup, and must not reach one: a KV key may not hold NATS subject
    wildcards (``*``, ``>``), spaces or non-ASCII (the client library raises), nor start or end
    with ``.``; and a key with a ``.`` inside names a different subject hierarchy."""
    return _ISSUED_ID.fullmatch(value) is not None


def last_event_id(request: Request, query_key: str) -> int:
    """The last event a resuming client has: ``Last-Event-ID``, or the ``query_key`` parameter;
    -1 (or absent): none, replay from the first event."""
    raw = request.headers.get("last-event-id", request.query_params.get(query_key, ""))
    if raw == "":
        return -1
    try:
        value = int(raw)
    except ValueError as exc:
        message = f"the last event id must be an integer, got {raw!r}"
        raise ApiError(400, message, param=query_key) from exc
    if value < -1:
        raise ApiError(400, f"the last event id must be >= -1, got {value}", param=query_key)
    return value


class Server:
    """What every API route needs to turn a stream of deltas into a response."""

    def __init__(
        self,
        service: GatewayService,
        served: ServedModel,
        retry_after_s: int,
        keepalive_s: float = 15.0,
        usage: ServedUsage | None = None,
    ) -> None:
        """``usage``: where every generation's usage is counted when it ends (the economics)."""
        self.service = service
        self.served = served
        self.retry_after_s = retry_after_s
        self.keepalive_s = keepalive_s
        self.usage = usage

    def generation(
        self, record: StreamRecord, collect: bool = False, observer: GenerationObserver | None = None
    ) -> Generation:
        """``collect``: the non-streaming body will be asked for; ``observer``: the request's metrics."""
        if self.usage is not None:
            observer = UsageObserver(self.usage, record, observer)
        renderer = renderer_for(record, collect)
        return Generation(record, self.served.tokenizer, renderer, self.served.keep_token_ids, observer)

    def sse(
        self,
        generation: Generation,
        stream: RequestStream,
        after: int = -1,
        on_done: OnDone | None = None,
    ) -> EventStreamResponse:
        """The stream as SSE, event ids = ordinals; ``on_done`` runs after the last event."""

        async def frames() -> AsyncIterator[str]:
            async for ordinal, event in numbered(generation.events(stream, self.keepalive_s), after):
                yield frame(event, ordinal)
            if generation.error:
                stream.close(failed=True)  # the other choices are cancelled at once
            elif on_done is not None:
                await on_done(generation)

        return EventStreamResponse(frames(), on_close=stream.close)

    async def body(
        self,
        request: Request,
        generation: Generation,
        stream: RequestStream,
        shape: Shape = "openai",
        on_done: OnDone | None = None,
    ) -> Response:
        """The whole response at once; 499 if the client left first (the request is then cancelled)."""

        async def drain() -> bool:
            async for _ in generation.events(stream):
                pass
            return True

        try:
            done = await until_disconnect(request, drain())
        finally:
            stream.close()
        if done is None:
            return Response(status_code=499)  # nobody is listening any more
        if generation.error:
            return error_response(ApiError(500, generation.error, type_="server_error"), shape)
        if on_done is not None:
            await on_done(generation)
        return JSONResponse(generation.renderer.body())

    async def respond(
        self,
        request: Request,
        admitted: Admitted,
        stream: bool,
        shape: Shape = "openai",
        on_done: OnDone | None = None,
    ) -> Response:
        """An admitted request's answer: its SSE stream, or its body. ``on_done`` runs once the
        generation ended without error (Responses stores the object then)."""
        generation = self.generation(admitted.record, not stream, watch_generation(request))
        if stream:
            return self.sse(generation, admitted.stream, on_done=on_done)
        return await self.body(request, generation, admitted.stream, shape, on_done)

    async def resume(self, request_id: str, api: str, after: int, tenant: str) -> EventStreamResponse:
        """``tenant``: the resuming client's; another tenant's stream is as unknown as a missing one."""
        record = await self.service.stream_record(request_id) if is_issued_id(request_id) else None
        if record is None or record.api != api or record.tenant != tenant:
            message = f"no resumable stream with id {shown(request_id)} (it may have expired)"
            raise ApiError(404, message, code="not_found")
        set_request_id(request_id)  # (an id this gateway issued: no client text in the log lines)
        generation = self.generation(record)
        stream = await self.service.replay(record, "never" if record.background else "grace")
        return self.sse(generation, stream, after)
