"""Stream resume: a client dropped mid-stream reconnects and gets exactly the events it missed.

Chat and Messages resume with ``GET .../{id}?stream=true`` and ``Last-Event-ID``; Responses with
OpenAI's ``GET /v1/responses/{id}?stream=true&starting_after=N``. Also across a gateway restart:
the first gateway is killed mid-stream and a new one serves the resume.

While its client is away a stream is paused: the out stream (watched here like any gateway's
consumer would see it) gets no tokens for it, and the resume recomputes over a prefix-cache hit.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import nats
import pytest

from libs.bus.nats_server import free_port
from libs.protocol.codec import decode
from libs.protocol.kv_messages import KVCacheStats
from libs.protocol.member_messages import WorkerLoad
from libs.protocol.messages import FinishReason, StepOutputs
from libs.protocol.subjects import Subjects
from tests.system.stack import READY_TIMEOUT_S, RESUME_GRACE_S, Stack, wait_healthy

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


# --- pause while the client is away ------------------------------------------------------------


@dataclass
class Watch:
    """What the bus shows of the requests: every output in the out stream (tokens so far, how and
    when each ended), the scheduler's prefix-cache hits, and the worker's block size."""

    num_tokens: dict[str, int] = field(default_factory=dict)  # request id -> output tokens so far
    num_prompt_tokens: dict[str, int] = field(default_factory=dict)
    ended: dict[str, tuple[FinishReason, float]] = field(default_factory=dict)  # -> (why, when)
    num_hit_tokens: float = 0.0  # the scheduler's, summed over tiers
    block_size: int = 0

    async def start(self, stack: Stack) -> nats.NATS:
        subjects = Subjects()
        nc = await nats.connect(stack.nats.url)

        async def on_out(msg: Any) -> None:
            for out in decode(StepOutputs, msg.data).outputs:
                self.num_tokens[out.request_id] = out.num_output_tokens
                self.num_prompt_tokens[out.request_id] = out.num_prompt_tokens
                if out.finish_reason is not None:
                    self.ended[out.request_id] = (out.finish_reason, time.monotonic())

        async def on_stats(msg: Any) -> None:
            stats = decode(KVCacheStats, msg.data)
            self.num_hit_tokens = sum(c.value for c in stats.counters if c.name == "hit_tokens")

        async def on_load(msg: Any) -> None:
            self.block_size = decode(WorkerLoad, msg.data).block_size

        await nc.subscribe(subjects.out_all, cb=on_out)
        await nc.subscribe(subjects.stats("scheduler", "*"), cb=on_stats)
        await nc.subscribe(subjects.load(stack.worker_id), cb=on_load)
        return nc


async def aread_events(lines: AsyncIterator[str], limit: int | None = None) -> list[SseEvent]:
    collected: list[str] = []
    async for line in lines:
        collected.append(line)
        if limit is not None and len(read_events(collected)) == limit:
            break  # leaving the stream block closes the connection
    return read_events(collected)


async def astream(http: httpx.AsyncClient, body: dict[str, Any], limit: int | None = None) -> list[SseEvent]:
    async with http.stream("POST", CHAT.post_path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        return await aread_events(resp.aiter_lines(), limit)


async def aresume(http: httpx.AsyncClient, request_id: str, last: int) -> list[SseEvent]:
    url, headers = CHAT.resume_url(request_id, last)
    async with http.stream("GET", url, headers=headers) as resp:
        assert resp.status_code == 200
        return await aread_events(resp.aiter_lines())


def chat_text(events: list[SseEvent]) -> str:
    chunks = [json.loads(e.data) for e in events if e.data != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_a_dropped_stream_pauses_then_resumes_exactly(stack: Stack) -> None:
    """Greedy: the resumed stream's text is the uninterrupted one's, and nothing was computed for
    it while its client was away; the resume hit the prefix cache over its prompt and outputs."""
    body = {**CHAT.body, "max_tokens": 96}
    num_before = 40  # events: the outputs then fill more than a block past the prompt

    async def run() -> None:
        watch = Watch()
        nc = await watch.start(stack)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
            whole = await astream(http, body)  # the uninterrupted answer
            before = await astream(http, body, limit=num_before)
            request_id = CHAT.request_id(before[0])
            await asyncio.sleep(1.0)  # the pause reached the scheduler; plans in flight came back
            num_paused_at, num_hit_before = watch.num_tokens[request_id], watch.num_hit_tokens
            await asyncio.sleep(1.5)
            assert request_id not in watch.ended, "it finished before the resume: a longer answer needed"
            assert watch.num_tokens[request_id] == num_paused_at  # no step ran for it while paused
            after = await aresume(http, request_id, before[-1].id)
            full = await aresume(http, request_id, -1)
            await asyncio.sleep(1.0)  # the scheduler's stats come every 0.2 s
            num_hit = watch.num_hit_tokens - num_hit_before
        await nc.close()
        check_resumed(before, after, full)
        assert chat_text(before + after) == chat_text(whole)
        assert watch.ended[request_id][0] is not FinishReason.ABORT
        # The one admission since the snapshot is the resume's: its hit covers the prompt and all
        # the full blocks of outputs but (with two plans in flight when it paused) the last.
        bs, num_prompt = watch.block_size, watch.num_prompt_tokens[request_id]
        assert num_hit >= (num_prompt + num_paused_at - 1) // bs * bs - bs
        assert num_hit > num_prompt

    asyncio.run(run())


def test_clients_that_leave_after_the_first_token_cost_no_more_work(stack: Stack) -> None:
    """Eight streams whose clients leave after their first token compute nothing more while a
    ninth runs (they do not slow it), and are cancelled when the grace period ends."""
    body = {**CHAT.body, "max_tokens": 200, "temperature": 0.8, "seed": 3}

    async def run() -> None:
        watch = Watch()
        nc = await watch.start(stack)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:

            async def leave() -> tuple[str, float]:
                events = await astream(http, body, limit=2)
                return CHAT.request_id(events[0]), time.monotonic()  # the connection is closed

            left_at = dict(await asyncio.gather(*(leave() for _ in range(8))))
            ids = list(left_at)
            ninth = await astream(http, {**body, "max_tokens": 32})
            assert chat_text(ninth) and ninth[-1].data == "[DONE]"
            deadline = time.monotonic() + RESUME_GRACE_S + 30
            while not all(i in watch.ended for i in ids):
                assert time.monotonic() < deadline, "a paused stream was never cancelled"
                await asyncio.sleep(0.2)
        await nc.close()
        for request_id in ids:
            reason, ended_at = watch.ended[request_id]
            # (left_at is read after the client's close returns: the gateway may see it sooner)
            assert reason is FinishReason.ABORT and ended_at - left_at[request_id] >= RESUME_GRACE_S - 0.1
            # Its first tokens, and what plans already sent computed before the pause came.
            assert watch.num_tokens[request_id] <= 8, watch.num_tokens

    asyncio.run(run())
