"""The HTTP front (starlette): /v1/chat/completions, /v1/models, /health."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from libs.protocol.messages import SubmitStatus
from services.gateway.choices import Choices
from services.gateway.fields import ApiError
from services.gateway.openai_api import ChatRequest, parse_chat_request
from services.gateway.responses import ChunkWriter, usage
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService, RequestStream, SubmitRejected

log = logging.getLogger(__name__)

# submit status -> (HTTP status, OpenAI error type, code)
_REJECTED: dict[SubmitStatus, tuple[int, str, str | None]] = {
    SubmitStatus.QUEUE_FULL: (429, "rate_limit_error", "queue_full"),
    SubmitStatus.NO_WORKERS: (503, "server_error", "no_workers"),
    SubmitStatus.INVALID: (400, "invalid_request_error", None),
}


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


@dataclass(frozen=True, slots=True)
class Admitted:
    chat: ChatRequest
    stream: RequestStream
    num_prompt_tokens: int


class ChatRoutes:
    """Handlers of the OpenAI routes over one GatewayService and one ServedModel."""

    def __init__(self, service: GatewayService, served: ServedModel, retry_after_s: int) -> None:
        self.service = service
        self.served = served
        self.retry_after_s = retry_after_s

    async def health(self, request: Request) -> Response:
        if await self.service.healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.served.card()]})

    async def chat_completions(self, request: Request) -> Response:
        try:
            admitted = await self.admit(request)
        except ApiError as err:
            headers = {"Retry-After": str(self.retry_after_s)} if err.status == 429 else None
            return error_response(err, headers)
        writer = ChunkWriter(admitted.stream.request_id, self.served.name, admitted.chat.include_usage)
        if admitted.chat.stream:
            return EventStreamResponse(self.stream_chunks(admitted, writer), on_close=admitted.stream.close)
        return await self.complete(request, admitted, writer)

    async def admit(self, request: Request) -> Admitted:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"invalid JSON body: {exc}") from exc
        chat = parse_chat_request(body)
        self.served.check_model(chat.model)
        # Tokenizing a long prompt is CPU work: keep it off the event loop (tokenizers drops the GIL).
        prompt = await asyncio.to_thread(self.served.render, chat.messages)
        params = chat.sampling.resolve(self.served.check_length(len(prompt), chat.sampling.max_tokens))
        request_id = "chatcmpl-" + uuid.uuid4().hex
        try:
            stream = await self.service.submit(request_id, prompt, params, self.served.eos_token_id)
        except SubmitRejected as exc:
            status, type_, code = _REJECTED[exc.status]
            raise ApiError(status, str(exc), code=code, type_=type_) from exc
        return Admitted(chat, stream, len(prompt))

    async def stream_chunks(self, admitted: Admitted, writer: ChunkWriter) -> AsyncIterator[str]:
        """Each chunk carries one choice's delta; each choice ends with its own finish chunk."""
        choices = Choices(self.served.tokenizer, admitted.chat.sampling)
        for index in range(choices.n):
            yield sse(writer.chunk(index, {"role": "assistant", "content": ""}))
        async for event in choices.events(admitted.stream):
            if event.text or event.logprobs:
                yield sse(writer.chunk(event.index, {"content": event.text}, logprobs=event.logprobs))
            if event.finish_reason is not None:
                yield sse(writer.chunk(event.index, {}, event.finish_reason))
        if choices.error:
            yield sse(ApiError(500, choices.error, type_="server_error").body())
        elif admitted.chat.include_usage:
            yield sse(writer.usage_chunk(self._usage(admitted, choices)))
        yield "data: [DONE]\n\n"

    async def complete(self, request: Request, admitted: Admitted, writer: ChunkWriter) -> Response:
        choices = Choices(self.served.tokenizer, admitted.chat.sampling)
        try:
            collected = await until_disconnect(request, choices.collect(admitted.stream))
        finally:
            admitted.stream.close()
        if collected is None:
            return Response(status_code=499)  # nobody is listening any more
        if choices.error:
            return error_response(ApiError(500, choices.error, type_="server_error"))
        return JSONResponse(writer.completion(collected, self._usage(admitted, choices)))

    @staticmethod
    def _usage(admitted: Admitted, choices: Choices) -> dict[str, Any]:
        return usage(admitted.num_prompt_tokens, choices.num_output_tokens)


def build_app(service: GatewayService, served: ServedModel, retry_after_s: int = 1) -> Starlette:
    """``retry_after_s``: the Retry-After of a 429 (the scheduler's queue is full)."""
    routes = ChatRoutes(service, served, retry_after_s)
    return Starlette(
        routes=[
            Route("/health", routes.health),
            Route("/v1/models", routes.models),
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        ]
    )


class EventStreamResponse(StreamingResponse):
    """SSE whose ``on_close`` runs however the response ends: done, client gone, or never started.

    A disconnect can cancel the response before the generator's first step, when a ``finally``
    inside the generator would never run; this is where the request gets cancelled then.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def until_disconnect(request: Request, work: Any) -> Any:
    """Run ``work``; if the client disconnects first, cancel it and return None."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None
