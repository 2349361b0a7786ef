"""Server-sent events: framing with ids, a response that always runs its close hook, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.gateway.generation import KEEPALIVE, Event

T = TypeVar("T")


def frame(event: Event, event_id: int | None = None) -> str:
    """One SSE event. ``id:`` is what a client sends back as Last-Event-ID to resume after it.
    A keep-alive is a comment line: clients skip it, proxies see the connection is alive."""
    if event is KEEPALIVE:
        return ": keep-alive\n\n"
    head = "" if event_id is None else f"id: {event_id}\n"
    if event.name is not None:
        head += f"event: {event.name}\n"
    data = event.data if isinstance(event.data, str) else dumps(event.data)
    return f"{head}data: {data}\n\n"


def dumps(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


class EventStreamResponse(StreamingResponse):
    """SSE whose ``on_close`` runs however the response ends: done, client gone, or never started.

    A disconnect can cancel the response before the generator's first step, when a ``finally``
    inside the generator would never run; this is where the request gets released then.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
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
