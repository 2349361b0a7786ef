"""One ApiRenderer per API over the recipe's event encoders: the SSE events and the non-stream body.

With ``collect`` (a non-streaming request) a renderer feeds every event it emits to its API's
accumulator, so ``body()`` is built from exactly what a stream would have carried; a stream,
which never asks for the body, skips that work. Responses keep the object in the encoder itself.
"""

from __future__ import annotations

import json
import time
from typing import Any

from libs.protocol.stream_messages import StreamRecord
from libs.recipe.events_chat import ChatAccumulator, ChatEncoder, chat_usage
from libs.recipe.events_messages import MessagesAccumulator, MessagesEncoder
from libs.recipe.events_responses import ResponsesEncoder
from libs.recipe.fields import ApiError
from libs.recipe.segments import Content, Finish, Reasoning, Segment, ToolCallArgs, Usage
from services.gateway.generation import ApiRenderer, Event

DONE = Event(None, "[DONE]")


def openai_close(usage_chunk: dict[str, Any], error: str, include_usage: bool) -> list[Event]:
    """An OpenAI stream's end: an error (a mid-stream failure) or the usage chunk if asked, then [DONE]."""
    if error:
        return [Event(None, ApiError(500, error, type_="server_error").body()), DONE]
    return [Event(None, usage_chunk), DONE] if include_usage else [DONE]


class ChatRenderer:
    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        *,
        n: int,
        thinking: bool,
        include_usage: bool,
        collect: bool = False,
    ) -> None:
        self._encoder = ChatEncoder(
            request_id, model, created, reasoning=thinking, n=n, include_usage=include_usage
        )
        self._accumulator = ChatAccumulator() if collect else None
        self._n = n
        self._include_usage = include_usage
        self._usage = Usage(0, 0)

    def _out(self, chunks: list[dict[str, Any]]) -> list[Event]:
        if self._accumulator is not None:
            for chunk in chunks:
                self._accumulator.add(chunk)
        return [Event(None, chunk) for chunk in chunks]

    def open(self, usage: Usage) -> list[Event]:
        return self._out([c for i in range(self._n) for c in self._encoder.start(i)])

    def feed(self, index: int, segments: list[Segment], logprobs: list[dict[str, Any]] | None) -> list[Event]:
        return self._out(self._encoder.feed(index, segments, logprobs))

    def end_choice(self, index: int, finish: Finish) -> list[Event]:
        return self._out(self._encoder.finish(index, finish))

    def close(self, usage: Usage, error: str) -> list[Event]:
        self._usage = usage
        return openai_close(self._encoder.usage_chunk(usage), error, self._include_usage)

    def body(self) -> dict[str, Any]:
        assert self._accumulator is not None, "built without collect"
        body = self._accumulator.result()
        body["usage"] = chat_usage(self._usage)
        return body


class CompletionsRenderer:
    """Legacy Completions (``text_completion``): text only (reasoning and tools do not apply), and
    the legacy logprobs shape (tokens, token_logprobs, top_logprobs as {token: logprob} maps,
    text_offset in characters of the choice's text, echo included)."""

    def __init__(self, request_id: str, model: str, created: int, *, n: int, echo: str, include_usage: bool):
        self._head = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        self._texts: list[list[str]] = [[] for _ in range(n)]
        self._logprobs: list[dict[str, list[Any]] | None] = [None] * n
        self._offsets = [len(echo)] * n
        self._finish: list[str | None] = [None] * n
        self._echo = echo
        self._include_usage = include_usage
        self._usage = Usage(0, 0)

    def _chunk(
        self, index: int, text: str, entries: list[dict[str, Any]] | None, finish_reason: str | None = None
    ) -> Event:
        self._texts[index].append(text)
        choice = {
            "index": index,
            "text": text,
            "logprobs": None if entries is None else self._legacy(index, entries),
            "finish_reason": finish_reason,
        }
        body: dict[str, Any] = {**self._head, "choices": [choice]}
        if self._include_usage:
            body["usage"] = None
        return Event(None, body)

    def _legacy(self, index: int, entries: list[dict[str, Any]]) -> dict[str, list[Any]]:
        part: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for entry in entries:
            part["tokens"].append(entry["token"])
            part["token_logprobs"].append(entry["logprob"])
            part["top_logprobs"].append({top["token"]: top["logprob"] for top in entry["top_logprobs"]})
            part["text_offset"].append(self._offsets[index])
            self._offsets[index] += len(entry["token"])
        whole = self._logprobs[index]
        if whole is None:
            whole = self._logprobs[index] = {key: [] for key in part}
        for key, values in part.items():
            whole[key] += values
        return part

    def open(self, usage: Usage) -> list[Event]:
        return [self._chunk(i, self._echo, None) for i in range(len(self._texts)) if self._echo]

    def feed(self, index: int, segments: list[Segment], logprobs: list[dict[str, Any]] | None) -> list[Event]:
        text = "".join(s.text for s in segments if isinstance(s, Content | Reasoning | ToolCallArgs))
        return [self._chunk(index, text, logprobs)] if text or logprobs else []

    def end_choice(self, index: int, finish: Finish) -> list[Event]:
        reason = "length" if finish.reason == "length" else "stop"
        self._finish[index] = reason
        return [self._chunk(index, "", None, reason)]

    def close(self, usage: Usage, error: str) -> list[Event]:
        self._usage = usage
        usage_chunk = {**self._head, "choices": [], "usage": chat_usage(usage)}
        return openai_close(usage_chunk, error, self._include_usage)

    def body(self) -> dict[str, Any]:
        choices = [
            {"index": i, "text": "".join(t), "logprobs": self._logprobs[i], "finish_reason": self._finish[i]}
            for i, t in enumerate(self._texts)
        ]
        return {**self._head, "choices": choices, "usage": chat_usage(self._usage)}


class ResponsesRenderer:
    """``skeleton``: the response object's echoed settings (id, created_at, model, tools, ...). The
    encoder keeps the object as it stands, so the body needs no accumulator."""

    def __init__(self, skeleton: dict[str, Any], *, queued: bool = False) -> None:
        self._encoder = ResponsesEncoder(skeleton)
        self._queued = queued
        self._finish = Finish("eos")  # held until ``close`` brings the usage

    def open(self, usage: Usage) -> list[Event]:
        return _named(self._encoder.start(queued=self._queued))

    def feed(self, index: int, segments: list[Segment], logprobs: list[dict[str, Any]] | None) -> list[Event]:
        return _named(self._encoder.feed(segments))

    def end_choice(self, index: int, finish: Finish) -> list[Event]:
        self._finish = finish
        return []

    def close(self, usage: Usage, error: str) -> list[Event]:
        finish = Finish("error", error=error) if error else self._finish
        return _named(self._encoder.finish(finish, usage, int(time.time())))

    @property
    def response(self) -> dict[str, Any]:
        """The object as it stands (also for a cancelled response, which has no terminal event)."""
        return self._encoder.response

    def body(self) -> dict[str, Any]:
        return self._encoder.response


class MessagesRenderer:
    """``message_start`` waits for the first output: it carries the prompt's (cached) token counts."""

    def __init__(self, message_id: str, model: str, collect: bool = False) -> None:
        self._encoder = MessagesEncoder(message_id, model, signature=message_id)
        self._accumulator = MessagesAccumulator() if collect else None
        self._finish = Finish("eos")  # held until ``close`` brings the usage

    def _out(self, events: list[dict[str, Any]]) -> list[Event]:
        if self._accumulator is not None:
            for event in events:
                self._accumulator.add(event)
        return _named(events)

    def open(self, usage: Usage) -> list[Event]:
        return self._out(self._encoder.start(usage))

    def feed(self, index: int, segments: list[Segment], logprobs: list[dict[str, Any]] | None) -> list[Event]:
        return self._out(self._encoder.feed(segments))

    def end_choice(self, index: int, finish: Finish) -> list[Event]:
        self._finish = finish
        return []

    def close(self, usage: Usage, error: str) -> list[Event]:
        finish = Finish("error", error=error) if error else self._finish
        return self._out(self._encoder.finish(finish, usage))

    def body(self) -> dict[str, Any]:
        assert self._accumulator is not None, "built without collect"
        return self._accumulator.result()


def _named(events: list[dict[str, Any]]) -> list[Event]:
    """Responses and Messages events: the SSE event name is the event's type."""
    return [Event(event["type"], event) for event in events]


def renderer_for(record: StreamRecord, collect: bool = False) -> ApiRenderer:
    """The renderer of a request, from its record; ``collect``: the body will be asked for."""
    context: dict[str, Any] = json.loads(record.context) if record.context else {}
    if record.api == "chat":
        return ChatRenderer(
            record.request_id,
            record.model,
            record.created,
            n=record.n,
            thinking=record.thinking,
            include_usage=record.include_usage,
            collect=collect,
        )
    if record.api == "completions":
        return CompletionsRenderer(
            record.request_id,
            record.model,
            record.created,
            n=record.n,
            echo=context.get("echo", ""),
            include_usage=record.include_usage,
        )
    if record.api == "responses":
        return ResponsesRenderer(context["skeleton"], queued=context.get("queued", False))
    if record.api == "messages":
        return MessagesRenderer(record.request_id, record.model, collect)
    raise ValueError(f"unknown api {record.api!r} in a stream record")
