"""OpenAI Chat Completions and Completions: POST (stream or not) and GET to resume a stream."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from libs.recipe.api.chat import parse_chat_request
from libs.recipe.api.completions import parse_completion_request
from libs.recipe.fields import ApiError
from libs.recipe.template_format import Prompt
from services.gateway.admission import Admission
from services.gateway.caller import caller_of
from services.gateway.serving import Server, error_response, json_body, last_event_id


class OpenAIRoutes:
    def __init__(self, server: Server, admission: Admission) -> None:
        self.server = server
        self.admission = admission

    async def chat_completions(self, request: Request) -> Response:
        try:
            chat = parse_chat_request(await json_body(request))
            self.server.served.check_model(chat.model)
            scope = self.admission.scope(request, "openai", chat.cache_retention)
            prompt = await self.admission.prompt(chat.conversation)
            admitted = await self.admission.admit(
                "chat",
                "chatcmpl-" + uuid.uuid4().hex,
                prompt,
                chat.sampling,
                created=int(time.time()),
                resumable=chat.stream,
                include_usage=chat.include_usage,
                scope=scope,
                caller=caller_of(request),
                prediction=chat.prediction,
            )
        except ApiError as err:
            return error_response(err, retry_after_s=self.server.retry_after_s)
        return await self.server.respond(request, admitted, chat.stream)

    async def completions(self, request: Request) -> Response:
        try:
            served = self.server.served
            req = parse_completion_request(await json_body(request), served.num_token_ids)
            served.check_model(req.model)
            scope = self.admission.scope(request, "openai", req.cache_retention)
            if isinstance(req.prompt, str):
                token_ids = await asyncio.to_thread(served.encode_text, req.prompt)  # CPU work
                echo = req.prompt if req.echo else ""
            else:
                token_ids = list(req.prompt)
                echo = served.tokenizer.decode(token_ids, skip_special_tokens=False) if req.echo else ""
            if not token_ids:  # no BOS is added: an empty text is no tokens, which nothing can continue
                raise ApiError(400, "the prompt must not be empty", param="prompt")
            prompt = Prompt(
                token_ids, syntax="plain", start="content", parse_tool_calls=False, thinking=False
            )
            admitted = await self.admission.admit(
                "completions",
                "cmpl-" + uuid.uuid4().hex,
                prompt,
                req.sampling,
                created=int(time.time()),
                resumable=req.stream,
                include_usage=req.include_usage,
                context=json.dumps({"echo": echo}).encode(),
                scope=scope,
                caller=caller_of(request),
            )
        except ApiError as err:
            return error_response(err, retry_after_s=self.server.retry_after_s)
        return await self.server.respond(request, admitted, req.stream)

    async def resume_chat(self, request: Request) -> Response:
        return await self._resume(request, "chat")

    async def resume_completion(self, request: Request) -> Response:
        return await self._resume(request, "completions")

    async def _resume(self, request: Request, api: str) -> Response:
        """``GET .../{id}?stream=true`` with ``Last-Event-ID``: the events after it, then live."""
        try:
            if request.query_params.get("stream", "true").lower() != "true":
                raise ApiError(400, "only a stream can be resumed: pass stream=true", param="stream")
            after = last_event_id(request, "last_event_id")
            tenant = self.admission.tenant(request, "openai")
            return await self.server.resume(request.path_params["request_id"], api, after, tenant)
        except ApiError as err:
            return error_response(err)
