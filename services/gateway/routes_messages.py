"""Anthropic Messages: POST /v1/messages (stream or not), count_tokens, and GET to resume a stream."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from libs.recipe.api.messages import parse_count_tokens_request, parse_messages_request
from libs.recipe.fields import ApiError
from services.gateway.admission import Admission
from services.gateway.caller import caller_of
from services.gateway.serving import Server, error_response, json_body, last_event_id


class MessagesRoutes:
    def __init__(self, server: Server, admission: Admission) -> None:
        self.server = server
        self.admission = admission

    async def messages(self, request: Request) -> Response:
        try:
            req = parse_messages_request(await json_body(request))
            self.server.served.check_model(req.model)
            scope = self.admission.scope(request, "anthropic", req.cache_retention)
            prompt = await self.admission.prompt(req.conversation, "output_config.format")
            admitted = await self.admission.admit(
                "messages",
                "msg_" + uuid.uuid4().hex,
                prompt,
                req.sampling,
                created=int(time.time()),
                resumable=req.stream,
                scope=scope,
                caller=caller_of(request),
            )
        except ApiError as err:
            return error_response(err, "anthropic", self.server.retry_after_s)
        return await self.server.respond(request, admitted, req.stream, "anthropic")

    async def count_tokens(self, request: Request) -> Response:
        try:
            req = parse_count_tokens_request(await json_body(request))
            self.server.served.check_model(req.model)
            prompt = await self.admission.prompt(
                req.conversation, "output_config.format", encode_images=False
            )
        except ApiError as err:
            return error_response(err, "anthropic")
        return JSONResponse({"input_tokens": len(prompt.token_ids)})

    async def resume(self, request: Request) -> Response:
        """``GET /v1/messages/{id}?stream=true`` with ``Last-Event-ID``: the events after it, then live."""
        try:
            after = last_event_id(request, "last_event_id")
            tenant = self.admission.tenant(request, "anthropic")
            return await self.server.resume(request.path_params["request_id"], "messages", after, tenant)
        except ApiError as err:
            return error_response(err, "anthropic")
