"""Serving one generation over HTTP, whatever the API: as SSE with ids, as one body, or resumed.

Error bodies follow the API: OpenAI's ``{"error": {message, type, param, code}}`` or Anthropic's
``{"type": "error", "error": {type, message}}``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from libs.protocol.messages import StreamRecord
from libs.recipe.fields import ApiError
from services.gateway.admission import Admitted
from services.gateway.generation import Generation, numbered
from services.gateway.renderers import renderer_for
from services.gateway.request_stream import RequestStream
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService
from services.gateway.sse import EventStreamResponse, frame, until_disconnect

Shape = Literal["openai", "anthropic"]
OnDone = Callable[[Generation], Awaitable[None]]
MAX_BODY_BYTES = 32 << 20  # a 1M-token prompt is ~4 MB of text; anything far past that is a mistake

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
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
    raw = b"".join(chunks)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"invalid JSON body: {exc}") from exc


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
        self, service: GatewayService, served: ServedModel, retry_after_s: int, keepalive_s: float = 15.0
    ) -> None:
        self.service = service
        self.served = served
        self.retry_after_s = retry_after_s
        self.keepalive_s = keepalive_s

    def generation(self, record: StreamRecord, collect: bool = False) -> Generation:
        """``collect``: the non-streaming body will be asked for."""
        renderer = renderer_for(record, collect)
        return Generation(record, self.served.tokenizer, renderer, self.served.keep_token_ids)

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
        generation = self.generation(admitted.record, collect=not stream)
        if stream:
            return self.sse(generation, admitted.stream, on_done=on_done)
        return await self.body(request, generation, admitted.stream, shape, on_done)

    async def resume(self, request_id: str, api: str, after: int, tenant: str) -> EventStreamResponse:
        """``tenant``: the resuming client's; another tenant's stream is as unknown as a missing one."""
        record = await self.service.stream_record(request_id)
        if record is None or record.api != api or record.tenant != tenant:
            raise ApiError(
                404, f"no resumable stream with id {request_id!r} (it may have expired)", code="not_found"
            )
        generation = self.generation(record)
        stream = await self.service.replay(record, "never" if record.background else "grace")
        return self.sse(generation, stream, after)
