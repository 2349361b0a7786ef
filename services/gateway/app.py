"""The HTTP front (starlette): every API's routes, /v1/models, /health (= /readyz), /livez and
/metrics, over one GatewayService."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.gateway.admission import Admission
from services.gateway.auth import KeyCheck, KeyFile
from services.gateway.cache_scope import CacheScoping
from services.gateway.dashboard import dashboard
from services.gateway.economics import PriceList
from services.gateway.image_admission import ImageAdmission
from services.gateway.metrics import GatewayMetrics, RequestMetrics
from services.gateway.response_store import ResponseStore
from services.gateway.routes_messages import MessagesRoutes
from services.gateway.routes_openai import OpenAIRoutes
from services.gateway.routes_responses import ResponsesRoutes
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService
from services.gateway.serving import LastResort, Server, http_error


def build_app(
    service: GatewayService,
    served: ServedModel,
    store: ResponseStore,
    retry_after_s: int = 1,
    keepalive_s: float = 15.0,
    scoping: CacheScoping | None = None,
    keys: KeyFile | None = None,
    prices: PriceList | None = None,
    images: ImageAdmission | None = None,
) -> Starlette:
    """``retry_after_s``: the Retry-After of a 429 (the scheduler's queue is full);
    ``keepalive_s``: the longest silence on an SSE stream before a keep-alive comment;
    ``scoping``: how a request's tenant and retention class are read (default classes, no tenant header);
    ``keys``: the API keys every /v1 route checks (None: no check);
    ``prices``: the price list and rental the serving economics use (default: ``PriceList()``);
    ``images``: how requests' images are checked and encoded (None: every image is refused)."""
    gateway_metrics = GatewayMetrics(service, prices, per_tenant=keys is not None)
    server = Server(service, served, retry_after_s, keepalive_s, gateway_metrics.served)
    admission = Admission(service, served, scoping, images)

    async def health(request: Request) -> Response:
        """Readiness: a live scheduler and worker can serve (from state a watcher keeps current)."""
        if service.ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def livez(request: Request) -> Response:
        """Liveness: the gateway process answers, whatever the rest is doing."""
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [served.card()]})

    async def metrics(request: Request) -> Response:
        return Response(gateway_metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/readyz", health),
            Route("/livez", livez),
            Route("/v1/models", models),
            Route("/metrics", metrics),
            Route("/dashboard", dashboard),
            *api_routes(server, admission, store),
        ],
        # Outermost first: the key check runs inside the metrics, so refusals are counted too.
        middleware=[
            Middleware(LastResort),
            Middleware(RequestMetrics, metrics=gateway_metrics),
            Middleware(KeyCheck, keys=keys),
        ],
        exception_handlers={HTTPException: http_error},
    )


def api_routes(server: Server, admission: Admission, store: ResponseStore) -> list[Route]:
    """Every API's generation, resume and retrieval routes."""
    openai = OpenAIRoutes(server, admission)
    responses = ResponsesRoutes(server, admission, store)
    messages = MessagesRoutes(server, admission)
    return [
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
