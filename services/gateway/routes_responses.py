"""OpenAI Responses: create (stream, background, previous_response_id), retrieve, resume, cancel.

A response's id is its request id. Stored responses live in the responses bucket; a background
response runs in a task of this gateway that stores the object as it ends, while any number of
readers (the creating call with ``stream: true``, later ``GET ...?stream=true``) replay its events.
If that gateway dies, the next retrieval at any gateway adopts the response and finishes it there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from libs.protocol.stream_messages import StreamRecord
from libs.recipe.api.responses import ResponsesRequest, parse_responses_request
from libs.recipe.api.responses_input import parse_input
from libs.recipe.fields import ApiError, shown
from libs.recipe.segments import Usage
from services.gateway.admission import Admission, Admitted
from services.gateway.caller import caller_of
from services.gateway.generation import Generation
from services.gateway.renderers import ResponsesRenderer, renderer_for
from services.gateway.request_stream import RequestStream
from services.gateway.response_store import TERMINAL, ResponseStore, Stored, encode_items
from services.gateway.serving import Server, error_response, is_issued_id, json_body, last_event_id

log = logging.getLogger(__name__)
CANCEL_WAIT_S = 5.0  # how long a cancel waits for the background task to store the final object
# A stored response keeps its input items whole (images as their base64) in one bucket entry, which
# a NATS message must carry: an input past this is refused up front, not lost after its answer.
MAX_STORED_INPUT_BYTES = 6 << 20


def _input_items(body: dict[str, Any]) -> list[Any]:
    raw = body.get("input")
    return [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw or [])


def _not_found(response_id: str) -> ApiError:
    message = f"No response found with id {shown(response_id)}."
    return ApiError(404, message, param="response_id", code="not_found")


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
            scope = self.admission.scope(request, "openai", req.cache_retention)
            history = await self._history(req, scope.tenant)
            input_json = encode_items([*history, *_input_items(body)])
            if (req.store or req.background) and len(input_json) > MAX_STORED_INPUT_BYTES:
                why = (
                    f"the input (with its history) is {len(input_json)} bytes, over the "
                    f"{MAX_STORED_INPUT_BYTES} a stored response keeps: send 'store': false or smaller images"
                )
                raise ApiError(400, why, param="store")
            history_messages = parse_input(history)[0] if history else ()
            prompt = await self.admission.prompt(req.conversation(history_messages), "text.format")
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
                background=req.background,
                scope=scope,
                caller=caller_of(request),
            )
        except ApiError as err:
            return error_response(err, retry_after_s=self.server.retry_after_s)
        if req.background:
            return await self._background(req, admitted, input_json)

        async def store(done: Generation) -> None:
            await self.store.put(done.renderer.body(), input_json, scope.tenant)

        return await self.server.respond(request, admitted, req.stream, on_done=store if req.store else None)

    async def _history(self, req: ResponsesRequest, tenant: str) -> list[Any]:
        if req.previous_response_id is None:
            return []
        previous = req.previous_response_id
        history = await self.store.history(previous, tenant) if is_issued_id(previous) else None
        if history is None:
            raise ApiError(
                400,
                f"Previous response with id {shown(previous)} not found.",
                param="previous_response_id",
            )
        return history

    async def _background(self, req: ResponsesRequest, admitted: Admitted, input_json: bytes) -> Response:
        """Run to the end in a task of this gateway, whoever listens; store as it starts and ends."""
        queued = renderer_for(admitted.record)
        assert isinstance(queued, ResponsesRenderer)
        queued.open(Usage(0, 0))  # the queued object, before any output
        try:
            gateway_id = self.server.service.gateway_id
            await self.store.put(queued.response, input_json, admitted.record.tenant, owner=gateway_id)
        except BaseException:
            admitted.stream.close(failed=True)  # nobody could ever see it: do not run it
            raise
        self._run_to_end(admitted.record, admitted.stream, input_json)
        if not req.stream:
            return JSONResponse(queued.response)
        replay = await self.server.service.replay(admitted.record, "never")
        return self.server.sse(self.server.generation(admitted.record), replay)

    def _run_to_end(self, record: StreamRecord, stream: RequestStream, input_json: bytes) -> None:
        self._track(record.request_id, asyncio.create_task(self._finish(record, stream, input_json)))

    async def _finish(self, record: StreamRecord, stream: RequestStream, input_json: bytes) -> None:
        """Read the response to its end, whoever else listens, and store the final object."""
        generation = self.server.generation(record)
        try:
            async for _ in generation.events(stream):
                pass
        finally:
            stream.close()
        final = generation.renderer
        assert isinstance(final, ResponsesRenderer)
        await self.store.put(final.response, input_json, record.tenant)

    def _track(self, response_id: str, task: asyncio.Task[None]) -> None:
        self._running[response_id] = task

        def done(task: asyncio.Task[None]) -> None:
            if self._running.get(response_id) is task:
                del self._running[response_id]
            if not task.cancelled() and task.exception() is not None:
                log.error("background response %s: %s", response_id, task.exception())

        task.add_done_callback(done)

    def _adopt(self, stored: Stored) -> None:
        """A background response still running whose gateway is gone: finish (and store) it here.

        Its step outputs are in the out stream; replaying them renders the same response. The
        owner is checked in a task (membership and the stream record are round trips)."""
        response_id = stored.response["id"]
        if stored.response.get("status") in TERMINAL or response_id in self._running:
            return
        self._track(response_id, asyncio.create_task(self._take_over(stored)))

    async def _take_over(self, stored: Stored) -> None:
        service, response = self.server.service, stored.response
        mine = stored.owner == service.gateway_id  # we restarted under the same id: the run died
        if not mine and await service.gateway_alive(stored.owner):
            return
        record = await service.stream_record(response["id"])
        if record is None:
            return  # past the out stream's retention: it cannot be finished
        await self.store.put(response, stored.input_json, stored.tenant, owner=service.gateway_id)
        stream = await service.replay(record, "never")
        log.info("adopted background response %s of gateway %s", response["id"], stored.owner)
        await self._finish(record, stream, stored.input_json)

    async def retrieve(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        try:
            tenant = self.admission.tenant(request, "openai")
            if request.query_params.get("stream", "false").lower() == "true":
                after = last_event_id(request, "starting_after")
                return await self.server.resume(response_id, "responses", after, tenant)
            found = await self._get(response_id, tenant)
            if found is None:
                raise _not_found(response_id)
        except ApiError as err:
            return error_response(err)
        self._adopt(found)
        return JSONResponse(found.response)

    async def cancel(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        try:
            tenant = self.admission.tenant(request, "openai")
            found = await self._get(response_id, tenant)
            if found is None:
                raise _not_found(response_id)
            if not found.response.get("background"):
                raise ApiError(400, "Only responses created with background=true can be cancelled.")
        except ApiError as err:
            return error_response(err)
        if found.response.get("status") in TERMINAL:
            return JSONResponse(found.response)
        service = self.server.service
        service.cancel_soon(response_id)
        running = self._running.get(response_id)
        if running is not None:  # ours: its task stores the cancelled object as it ends
            await asyncio.wait({running}, timeout=CANCEL_WAIT_S)
        elif await service.gateway_alive(found.owner):
            await self._until_terminal(response_id, tenant)
        after = await self.store.get(response_id, tenant)
        if after is not None and after.response.get("status") in TERMINAL:
            return JSONResponse(after.response)
        # Nobody stores its end (the gateway running it is gone): the cancel is the end.
        response = {**found.response, "status": "cancelled"}
        await self.store.put(response, found.input_json, tenant)
        return JSONResponse(response)

    async def _get(self, response_id: str, tenant: str) -> Stored | None:
        """The stored response a client names; an id this gateway never issues is in no store."""
        return await self.store.get(response_id, tenant) if is_issued_id(response_id) else None

    async def _until_terminal(self, response_id: str, tenant: str) -> None:
        """Another gateway runs it: wait (backing off) for it to store the end."""
        delay, deadline = 0.05, time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            await asyncio.sleep(delay)
            found = await self.store.get(response_id, tenant)
            if found is not None and found.response.get("status") in TERMINAL:
                return
            delay = min(delay * 2, 0.5)
