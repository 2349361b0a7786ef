"""The HTTP front (starlette): every API's routes, /v1/models, /health and /metrics, over one
GatewayService."""

from __future__ import annotations

import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.gateway.admission import Admission
from services.gateway.cache_scope import CacheScoping
from services.gateway.metrics import Sample, kv_samples, render
from services.gateway.response_store import ResponseStore
from services.gateway.routes_messages import MessagesRoutes
from services.gateway.routes_openai import OpenAIRoutes
from services.gateway.routes_responses import ResponsesRoutes
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService
from services.gateway.serving import Server


def build_app(
    service: GatewayService,
    served: ServedModel,
    store: ResponseStore,
    retry_after_s: int = 1,
    keepalive_s: float = 15.0,
    scoping: CacheScoping | None = None,
) -> Starlette:
    """``retry_after_s``: the Retry-After of a 429 (the scheduler's queue is full);
    ``keepalive_s``: the longest silence on an SSE stream before a keep-alive comment;
    ``scoping``: how a request's tenant and retention class are read (default classes, no tenant header)."""
    server = Server(service, served, retry_after_s, keepalive_s)
    admission = Admission(service, served, scoping)
    openai = OpenAIRoutes(server, admission)
    responses = ResponsesRoutes(server, admission, store)
    messages = MessagesRoutes(server, admission)

    async def health(request: Request) -> Response:
        if await service.healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [served.card()]})

    async def metrics(request: Request) -> Response:
        own = Sample(
            "deepinfer_gateway_requests_in_flight", (("gateway", service.gateway_id),), service.num_in_flight
        )
        text = render([*kv_samples(service.kv_stats.current(time.monotonic())), own])
        return Response(text, media_type="text/plain; version=0.0.4")

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/metrics", metrics),
            Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
            Route("/v1/chat/completions/{request_id}", openai.resume_chat, methods=["GET"]),
            Route("/v1/completions", openai.completions, methods=["POST"]),
            Route("/v1/completions/{request_id}", openai.resume_completion, methods=["GET"]),
            Route("/v1/responses", responses.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}/cancel", responses.cancel, methods=["POST"]),
            Route("/v1/messages", messages.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
            Route("/v1/messages/{request_id}", messages.resume, methods=["GET"]),
        ]
    )
