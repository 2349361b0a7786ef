"""OpenAI Responses: create (stream, background, previous_response_id), retrieve, resume, cancel.

A response's id is its request id. Stored responses live in the responses bucket; a background
response runs in a task of this gateway that stores the object as it ends, while any number of
readers (the creating call with ``stream: true``, later ``GET ...?stream=true``) replay its events.
If that gateway dies, the next retrieval at any gateway adopts the response and finishes it there.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from libs.protocol.messages import StreamRecord
from libs.recipe.api.responses import ResponsesRequest, parse_responses_request
from libs.recipe.api.responses_input import parse_input
from libs.recipe.fields import ApiError
from libs.recipe.segments import Usage
from services.gateway.admission import Admission, Admitted
from services.gateway.generation import Generation
from services.gateway.renderers import ResponsesRenderer, renderer_for
from services.gateway.request_stream import RequestStream
from services.gateway.response_store import TERMINAL, ResponseStore
from services.gateway.serving import Server, error_response, json_body, last_event_id

CANCEL_WAIT_S = 5.0  # how long a cancel waits for the background task to store the final object


def _input_items(body: dict[str, Any]) -> list[Any]:
    raw = body.get("input")
    return [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw or [])


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"No response found with id '{response_id}'.", param="response_id", code="not_found")


class ResponsesRoutes:
    def __init__(self, server: Server, admission: Admission, store: ResponseStore) -> None:
        self.server = server
        self.admission = admission
        self.store = store
        self._running: dict[str, asyncio.Task[None]] = {}  # background responses run by this gateway

    async def create(self, request: Request) -> Response:
        try:
            body = await json_body(request)
            req = parse_responses_request(body)
            self.server.served.check_model(req.model)
            history = await self._history(req)
            input_items = [*history, *_input_items(body)]
            history_messages = parse_input(history)[0] if history else ()
            prompt = await self.admission.prompt(req.conversation(history_messages))
            response_id = "resp_" + uuid.uuid4().hex
            created = int(time.time())
            skeleton = {
                "id": response_id,
                "created_at": created,
                "model": self.server.served.name,
                **req.echo(),
            }
            context = json.dumps({"skeleton": skeleton, "queued": req.background}).encode()
            admitted = await self.admission.admit(
                "responses",
                response_id,
                prompt,
                req.sampling,
                created=created,
                resumable=req.stream or req.background,
                context=context,
            )
        except ApiError as err:
            return error_response(err, retry_after_s=self.server.retry_after_s)
        if req.background:
            return await self._background(req, admitted, input_items)
        generation = self.server.generation(admitted.record)

        async def store(done: Generation) -> None:
            if req.store:
                await self.store.put(done.renderer.body(), input_items)

        if req.stream:
            return self.server.sse(generation, admitted.stream, on_done=store)
        response = await self.server.body(request, generation, admitted.stream)
        if response is not None and response.status_code == 200:
            await store(generation)
        return response or Response(status_code=499)

    async def _history(self, req: ResponsesRequest) -> list[Any]:
        if req.previous_response_id is None:
            return []
        history = await self.store.history(req.previous_response_id)
        if history is None:
            raise ApiError(
                400,
                f"Previous response with id '{req.previous_response_id}' not found.",
                param="previous_response_id",
            )
        return history

    async def _background(
        self, req: ResponsesRequest, admitted: Admitted, input_items: list[Any]
    ) -> Response:
        """Run to the end in a task of this gateway, whoever listens; store as it starts and ends."""
        queued = renderer_for(admitted.record)
        assert isinstance(queued, ResponsesRenderer)
        queued.open(Usage(0, 0))  # the queued object, before any output
        await self.store.put(queued.response, input_items, admitted.record.request_id)
        self._run_to_end(admitted.record, admitted.stream, input_items)
        if not req.stream:
            return JSONResponse(queued.response)
        replay = await self.server.service.replay(admitted.record, cancel_on_close=False)
        return self.server.sse(self.server.generation(admitted.record), replay)

    def _run_to_end(self, record: StreamRecord, stream: RequestStream, input_items: list[Any]) -> None:
        generation = self.server.generation(record)

        async def run() -> None:
            try:
                async for _ in generation.events(stream):
                    pass
            finally:
                stream.close()
            final = generation.renderer
            assert isinstance(final, ResponsesRenderer)
            await self.store.put(final.response, input_items)

        task = asyncio.create_task(run())
        self._running[record.request_id] = task
        task.add_done_callback(lambda _: self._running.pop(record.request_id, None))

    async def _adopt(self, response: dict[str, Any], input_items: list[Any]) -> None:
        """A background response still running whose gateway is gone: finish (and store) it here.

        Its step outputs are in the out stream; replaying them renders the same response."""
        response_id = response["id"]
        if response.get("status") in TERMINAL or response_id in self._running:
            return
        record = await self.server.service.stream_record(response_id)
        if record is None or record.gateway_id in await self.server.service.live_gateways():
            return  # expired, or its own gateway is still on it
        stream = await self.server.service.replay(record, cancel_on_close=False)
        self._run_to_end(record, stream, input_items)

    async def retrieve(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        try:
            if request.query_params.get("stream", "false").lower() == "true":
                after = last_event_id(request, "starting_after")
                return await self.server.resume(response_id, "responses", after)
            found = await self.store.get(response_id)
            if found is None:
                raise _not_found(response_id)
        except ApiError as err:
            return error_response(err)
        await self._adopt(*found)
        return JSONResponse(found[0])

    async def cancel(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        try:
            found = await self.store.get(response_id)
            if found is None:
                raise _not_found(response_id)
            response, input_items = found
            if not response.get("background"):
                raise ApiError(400, "Only responses created with background=true can be cancelled.")
        except ApiError as err:
            return error_response(err)
        if response.get("status") in TERMINAL:
            return JSONResponse(response)
        self.server.service.cancel_soon(response_id)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            found = await self.store.get(response_id)
            if found is not None and found[0].get("status") in TERMINAL:
                return JSONResponse(found[0])
        # Nobody stored the end (the gateway running it is gone): the cancel is the end.
        response = {**response, "status": "cancelled"}
        await self.store.put(response, input_items)
        return JSONResponse(response)
