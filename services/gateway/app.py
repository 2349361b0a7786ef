"""The HTTP front (starlette): /v1/chat/completions, /v1/models, /health."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from libs.protocol.messages import SamplingParams, SubmitStatus
from services.gateway.openai_api import ApiError, ChatRequest, ChunkWriter, parse_chat_request, usage
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService, RequestStream, SubmitRejected
from services.gateway.text_stream import TextStream

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


def build_app(service: GatewayService, served: ServedModel) -> Starlette:
    async def health(request: Request) -> Response:
        if await service.healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [served.card()]})

    async def chat_completions(request: Request) -> Response:
        try:
            admitted = await admit(request)
        except ApiError as err:
            headers = {"Retry-After": "1"} if err.status == 429 else None
            return error_response(err, headers)
        writer = ChunkWriter(admitted.stream.request_id, served.name)
        if admitted.chat.stream:
            return StreamingResponse(
                stream_chunks(admitted, writer),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await complete(request, admitted, writer)

    async def admit(request: Request) -> Admitted:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"invalid JSON body: {exc}") from exc
        chat = parse_chat_request(body)
        served.check_model(chat.model)
        prompt = served.render(chat.messages)
        max_tokens = served.check_length(len(prompt), chat.max_tokens)
        params = SamplingParams(
            temperature=chat.temperature, top_p=chat.top_p, max_tokens=max_tokens, seed=chat.seed
        )
        request_id = "chatcmpl-" + uuid.uuid4().hex
        try:
            stream = await service.submit(request_id, prompt, params, served.eos_token_id)
        except SubmitRejected as exc:
            status, type_, code = _REJECTED[exc.status]
            raise ApiError(status, str(exc), code=code, type_=type_) from exc
        return Admitted(chat, stream, len(prompt))

    async def stream_chunks(admitted: Admitted, writer: ChunkWriter) -> AsyncIterator[str]:
        text = TextStream(served.tokenizer, admitted.chat.stop)
        try:
            yield sse(writer.chunk({"role": "assistant", "content": ""}))
            async for piece in text.pieces(admitted.stream):
                if piece:
                    yield sse(writer.chunk({"content": piece}))
            if text.error:
                yield sse(
                    {"error": {"message": text.error, "type": "server_error", "param": None, "code": None}}
                )
            else:
                yield sse(writer.chunk({}, text.finish_reason))
                if admitted.chat.include_usage:
                    yield sse(writer.usage_chunk(usage(admitted.num_prompt_tokens, text.num_output_tokens)))
            yield "data: [DONE]\n\n"
        finally:
            admitted.stream.close()  # cancels the request if the client left before the end

    async def complete(request: Request, admitted: Admitted, writer: ChunkWriter) -> Response:
        text = TextStream(served.tokenizer, admitted.chat.stop)

        async def collect() -> str:
            return "".join([p async for p in text.pieces(admitted.stream)])

        try:
            content = await until_disconnect(request, collect())
        finally:
            admitted.stream.close()
        if content is None:
            return Response(status_code=499)  # nobody is listening any more
        if text.error:
            return error_response(ApiError(500, text.error, type_="server_error"))
        return JSONResponse(
            writer.completion(
                content, text.finish_reason, usage(admitted.num_prompt_tokens, text.num_output_tokens)
            )
        )

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={ApiError: on_api_error})


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
