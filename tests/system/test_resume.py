"""Stream resume: a client dropped mid-stream reconnects and gets exactly the events it missed.

Chat and Messages resume with ``GET .../{id}?stream=true`` and ``Last-Event-ID``; Responses with
OpenAI's ``GET /v1/responses/{id}?stream=true&starting_after=N``. Also across a gateway restart:
the first gateway is killed mid-stream and a new one serves the resume.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from libs.bus.nats_server import free_port
from tests.system.stack import READY_TIMEOUT_S, Stack, wait_healthy

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Write a short poem about the sea."
NUM_BEFORE_DROP = 6


@dataclass(frozen=True)
class SseEvent:
    id: int
    name: str | None
    data: str


def read_events(lines: Any, limit: int | None = None) -> list[SseEvent]:
    events, fields = [], {}  # type: ignore[var-annotated]
    for line in lines:
        if line:
            key, _, value = line.partition(": ")
            fields[key] = value
            continue
        if "data" in fields:
            events.append(SseEvent(int(fields["id"]), fields.get("event"), fields["data"]))
            if limit is not None and len(events) == limit:
                return events
        fields = {}
    return events


@dataclass(frozen=True)
class Api:
    post_path: str
    body: dict[str, Any]
    resume_url: Callable[[str, int], tuple[str, dict[str, str]]]  # (id, last seen) -> url, headers
    request_id: Callable[[SseEvent], str]  # from the first event


CHAT = Api(
    "/chat/completions",
    {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40, "temperature": 0},
    lambda rid, last: (f"/chat/completions/{rid}?stream=true", {"Last-Event-ID": str(last)}),
    lambda first: json.loads(first.data)["id"],
)
MESSAGES = Api(
    "/messages",
    {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40, "temperature": 0},
    lambda rid, last: (f"/messages/{rid}?stream=true", {"Last-Event-ID": str(last)}),
    lambda first: json.loads(first.data)["message"]["id"],
)
RESPONSES = Api(
    "/responses",
    {"model": MODEL, "input": PROMPT, "max_output_tokens": 40, "temperature": 0},
    lambda rid, last: (f"/responses/{rid}?stream=true&starting_after={last}", {}),
    lambda first: json.loads(first.data)["response"]["id"],
)
APIS = {"chat": CHAT, "messages": MESSAGES, "responses": RESPONSES}


def drop_after(base_url: str, api: Api, n: int) -> list[SseEvent]:
    """Start a stream, read ``n`` events, hang up."""
    body = {**api.body, "stream": True}
    http = httpx.Client(base_url=base_url, timeout=60)
    with http, http.stream("POST", api.post_path, json=body) as resp:
        assert resp.status_code == 200
        return read_events(resp.iter_lines(), limit=n)


def resume(base_url: str, api: Api, request_id: str, last: int) -> list[SseEvent]:
    url, headers = api.resume_url(request_id, last)
    http = httpx.Client(base_url=base_url, timeout=60)
    with http, http.stream("GET", url, headers=headers) as resp:
        assert resp.status_code == 200, resp.read()
        return read_events(resp.iter_lines())


def comparable(event: SseEvent) -> SseEvent:
    """The Responses terminal event stamps completed_at when rendered: the one clock-bound field."""
    if event.name in ("response.completed", "response.incomplete"):
        data = json.loads(event.data)
        data["response"].pop("completed_at")
        return SseEvent(event.id, event.name, json.dumps(data))
    return event


def check_resumed(before: list[SseEvent], after: list[SseEvent], full: list[SseEvent]) -> None:
    assert [e.id for e in before] == list(range(len(before)))
    assert after[0].id == before[-1].id + 1  # nothing repeated
    assert [e.id for e in full] == list(range(len(full)))  # nothing lost
    assert [comparable(e) for e in before + after] == [comparable(e) for e in full]
    assert len(after) > 3  # the drop really was mid-stream


@pytest.mark.parametrize("name", APIS)
def test_reconnect_gets_exactly_the_missing_events(stack: Stack, name: str) -> None:
    api = APIS[name]
    before = drop_after(stack.base_url, api, NUM_BEFORE_DROP)
    request_id = api.request_id(before[0])
    after = resume(stack.base_url, api, request_id, before[-1].id)
    full = resume(stack.base_url, api, request_id, -1)  # the whole stream, replayed
    check_resumed(before, after, full)


def test_resume_after_the_gateway_restarts(stack: Stack) -> None:
    port = free_port()
    first = stack.spawn_gateway(port)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", [first], stack.log, READY_TIMEOUT_S)
        stored = httpx.post(f"http://127.0.0.1:{port}/v1/responses", json=RESPONSES.body, timeout=60).json()
        background = {**RESPONSES.body, "background": True}
        running = httpx.post(f"http://127.0.0.1:{port}/v1/responses", json=background, timeout=60).json()
        # Last, and killed at once: the drop starts the grace period, which must not run out.
        before = drop_after(f"http://127.0.0.1:{port}/v1", CHAT, NUM_BEFORE_DROP)
    finally:
        first.send_signal(signal.SIGKILL)  # no drain, no cancel: the request runs on
        first.wait()
    second = stack.spawn_gateway(port)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", [second], stack.log, READY_TIMEOUT_S)
        base = f"http://127.0.0.1:{port}/v1"
        request_id = CHAT.request_id(before[0])
        after = resume(base, CHAT, request_id, before[-1].id)
        full = resume(base, CHAT, request_id, -1)
        # A background response whose gateway died is finished by the next gateway that is asked.
        deadline = time.monotonic() + 120
        while (got := httpx.get(f"{base}/responses/{running['id']}").json())["status"] in (
            "queued",
            "in_progress",
        ):
            assert time.monotonic() < deadline, got
            time.sleep(0.5)
        assert (
            got["status"] == stored["status"]
            and got["output"][0]["content"] == stored["output"][0]["content"]
        )
        # A stored response outlives the gateway that made it, and chains from the new one.
        assert httpx.get(f"{base}/responses/{stored['id']}").json() == stored
        follow = {**RESPONSES.body, "input": "Again.", "previous_response_id": stored["id"]}
        assert httpx.post(f"{base}/responses", json=follow, timeout=60).json()["status"] in (
            "completed",
            "incomplete",
        )
    finally:
        second.terminate()
        second.wait()
    check_resumed(before, after, full)


def test_unknown_stream_is_a_404(stack: Stack) -> None:
    resp = httpx.get(f"{stack.base_url}/chat/completions/chatcmpl-nope?stream=true")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
