"""How a streamed request ended, read from its SSE bytes: for each API, what a completed stream,
a mid-stream error event and a cut-off stream look like. Pure: bytes in, a verdict out.

Chat and Completions: ``data: {...}`` chunks, an ``{"error": ...}`` chunk on failure, ``data: [DONE]``
last. Messages: ``event: error`` on failure, ``event: message_stop`` last. Responses:
``response.failed`` or ``error`` on failure, ``response.completed`` or ``response.incomplete`` last.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["completed", "error_event", "http_error", "dropped", "deadline"]
ApiName = Literal["chat", "completions", "messages", "responses"]
_COMPLETED_EVENTS = {
    "messages": {"message_stop"},
    "responses": {"response.completed", "response.incomplete"},
}
_ERROR_EVENTS = {"messages": {"error"}, "responses": {"response.failed", "error"}}
_TEXT_EVENTS = {"messages": "content_block_delta", "responses": "response.output_text.delta"}


@dataclass(frozen=True)
class StreamEnd:
    """``seconds``: from when the clock started (the request, or the fault) to the end."""

    kind: Kind
    detail: str
    num_tokens: int  # text-bearing events seen (about one token each)
    seconds: float


@dataclass(frozen=True)
class SseEvent:
    id: int | None
    name: str | None
    data: str


class SseParser:
    """Bytes in (any split), whole events out; comment lines (keep-alives) are skipped."""

    def __init__(self) -> None:
        self._buffer = b""
        self._fields: dict[str, str] = {}

    def feed(self, chunk: bytes) -> list[SseEvent]:
        self._buffer += chunk
        events = []
        while b"\n" in self._buffer:
            line_bytes, self._buffer = self._buffer.split(b"\n", 1)
            line = line_bytes.rstrip(b"\r").decode("utf-8", errors="replace")
            if line.startswith(":"):
                continue
            if line:
                key, _, value = line.partition(":")
                self._fields[key] = value.removeprefix(" ")
                continue
            if "data" in self._fields:
                raw_id = self._fields.get("id")
                event_id = int(raw_id) if raw_id is not None and raw_id.lstrip("-").isdigit() else None
                events.append(SseEvent(event_id, self._fields.get("event"), self._fields["data"]))
            self._fields = {}
        return events


@dataclass
class StreamState:
    """What one API's stream has shown so far; ``verdict`` once it reached its last event."""

    api: ApiName
    parser: SseParser = field(default_factory=SseParser)
    num_tokens: int = 0
    text: str = ""  # the OpenAI APIs' streamed text so far (first choice)
    request_id: str | None = None
    first_event_id: int | None = None
    last_event_id: int = -1
    verdict: tuple[Kind, str] | None = None

    def feed(self, chunk: bytes) -> None:
        for event in self.parser.feed(chunk):
            if event.id is not None:
                self.first_event_id = event.id if self.first_event_id is None else self.first_event_id
                self.last_event_id = event.id
            if self.verdict is None:
                self.verdict = self._read(event)

    def end(self, how: str = "the connection closed") -> tuple[Kind, str]:
        """The verdict once no more bytes come: ``how`` says why (EOF, a reset) for a cut-off stream."""
        if self.verdict is not None:
            return self.verdict
        return "dropped", f"{how} after {self.num_tokens} tokens, with no final event"

    def _read(self, event: SseEvent) -> tuple[Kind, str] | None:
        if self.api in ("chat", "completions"):
            return self._read_openai(event)
        data = _json(event.data)
        if self.request_id is None:
            self.request_id = _id_of(self.api, data)
        if event.name in _ERROR_EVENTS[self.api]:
            return "error_event", f"{event.name}: {event.data[:300]}"
        if event.name in _COMPLETED_EVENTS[self.api]:
            return "completed", str(event.name)
        if event.name == _TEXT_EVENTS[self.api]:
            self.num_tokens += 1
        return None

    def _read_openai(self, event: SseEvent) -> tuple[Kind, str] | None:
        if event.data == "[DONE]":
            return "completed", "[DONE]"
        data = _json(event.data)
        if not isinstance(data, dict):
            return "error_event", f"not a JSON object: {event.data[:300]}"
        if "error" in data:
            return "error_event", f"error chunk: {json.dumps(data['error'])[:300]}"
        if self.request_id is None and isinstance(data.get("id"), str):
            self.request_id = data["id"]
        for choice in data.get("choices") or []:
            text = (
                choice.get("text")
                if self.api == "completions"
                else (choice.get("delta") or {}).get("content")
            )
            self.num_tokens += bool(text)
            if choice.get("index", 0) == 0:
                self.text += text or ""
        return None


def _json(data: str) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


def _id_of(api: ApiName, data: Any) -> str | None:
    """The request id in a stream's first event (``message_start`` / ``response.created``)."""
    if not isinstance(data, dict):
        return None
    inner = data.get("message") if api == "messages" else data.get("response")
    return inner.get("id") if isinstance(inner, dict) and isinstance(inner.get("id"), str) else None


def classify(
    api: ApiName, status: int, chunks: list[bytes], how: str = "the connection closed"
) -> tuple[Kind, str, int]:
    """A whole stream's verdict: (kind, detail, num_tokens); a non-200 status is an http_error."""
    if status != 200:
        return "http_error", f"{status}: {b''.join(chunks)[:300]!r}", 0
    state = StreamState(api)
    for chunk in chunks:
        state.feed(chunk)
    kind, detail = state.end(how)
    return kind, detail, state.num_tokens
