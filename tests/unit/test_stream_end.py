"""The fault harness's stream-ending classifier on canned SSE bytes of each API, split anywhere."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.system.stream_end import SseParser, StreamState, classify


def sse(*events: tuple[str | None, Any], crlf: bool = False) -> bytes:
    """Events numbered from 0 as the gateway frames them; a keep-alive comment between each."""
    out = []
    for i, (name, data) in enumerate(events):
        head = f"id: {i}\n" + (f"event: {name}\n" if name else "")
        text = data if isinstance(data, str) else json.dumps(data)
        out.append(f"{head}data: {text}\n\n: keep-alive\n\n")
    joined = "".join(out)
    return (joined.replace("\n", "\r\n") if crlf else joined).encode()


def chunk(text: str, request_id: str = "chatcmpl-1") -> dict[str, Any]:
    return {"id": request_id, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


CHAT_OK = sse((None, chunk("")), (None, chunk("Hel")), (None, chunk("lo")), (None, "[DONE]"))
CHAT_ERROR = sse(
    (None, chunk("Hel")),
    (None, {"error": {"message": "worker died", "type": "server_error"}}),
    (None, "[DONE]"),
)
MSG_START = ("message_start", {"type": "message_start", "message": {"id": "msg_1"}})
MSG_DELTA = ("content_block_delta", {"type": "content_block_delta", "delta": {"text": "x"}})
MESSAGES_OK = sse(MSG_START, MSG_DELTA, MSG_DELTA, ("message_stop", {"type": "message_stop"}))
MESSAGES_ERROR = sse(MSG_START, MSG_DELTA, ("error", {"type": "error", "error": {"type": "api_error"}}))
RESP_CREATED = ("response.created", {"response": {"id": "resp_1", "status": "in_progress"}})
RESP_DELTA = ("response.output_text.delta", {"delta": "x"})
RESPONSES_INCOMPLETE = sse(RESP_CREATED, RESP_DELTA, ("response.incomplete", {"response": {}}))
RESPONSES_FAILED = sse(RESP_CREATED, RESP_DELTA, RESP_DELTA, ("response.failed", {"response": {}}))


def split(raw: bytes, size: int) -> list[bytes]:
    return [raw[i : i + size] for i in range(0, len(raw), size)]


@pytest.mark.parametrize("size", [1, 7, 10_000])
@pytest.mark.parametrize(
    ("api", "raw", "kind", "num_tokens", "request_id"),
    [
        ("chat", CHAT_OK, "completed", 2, "chatcmpl-1"),
        ("chat", CHAT_ERROR, "error_event", 1, "chatcmpl-1"),
        ("chat", CHAT_OK[: CHAT_OK.index(b"[DONE]")], "dropped", 2, "chatcmpl-1"),
        ("messages", MESSAGES_OK, "completed", 2, "msg_1"),
        ("messages", MESSAGES_ERROR, "error_event", 1, "msg_1"),
        ("messages", MESSAGES_OK[: MESSAGES_OK.index(b"event: message_stop")], "dropped", 2, "msg_1"),
        ("responses", RESPONSES_INCOMPLETE, "completed", 1, "resp_1"),
        ("responses", RESPONSES_FAILED, "error_event", 2, "resp_1"),
        ("responses", sse(RESP_CREATED, ("error", {"code": "server_error"})), "error_event", 0, "resp_1"),
        ("responses", sse(RESP_CREATED, RESP_DELTA), "dropped", 1, "resp_1"),
        ("chat", b"", "dropped", 0, None),
    ],
)
def test_each_ending_is_told_apart_however_the_bytes_split(
    api: Any, raw: bytes, kind: str, num_tokens: int, request_id: str | None, size: int
) -> None:
    assert classify(api, 200, split(raw, size))[::2] == (kind, num_tokens)
    state = StreamState(api)
    for part in split(raw, size):
        state.feed(part)
    assert state.request_id == request_id


def test_the_first_final_event_decides() -> None:
    # An error chunk then [DONE]: the error is how it ended; the last event id is still tracked.
    state = StreamState("chat")
    state.feed(CHAT_ERROR)
    assert state.end()[0] == "error_event" and (state.first_event_id, state.last_event_id) == (0, 2)


def test_crlf_lines_and_comments() -> None:
    events = SseParser().feed(sse(MSG_START, ("message_stop", {}), crlf=True))
    assert [(e.id, e.name) for e in events] == [(0, "message_start"), (1, "message_stop")]


def test_a_cut_off_stream_says_how_it_was_cut() -> None:
    kind, detail, _ = classify("chat", 200, [CHAT_OK[:40]], how="RemoteProtocolError: peer closed")
    assert kind == "dropped" and "RemoteProtocolError" in detail


def test_a_non_200_is_an_http_error() -> None:
    kind, detail, num_tokens = classify("messages", 503, [b'{"type":"error"}'])
    assert (kind, num_tokens) == ("http_error", 0) and detail.startswith("503")
