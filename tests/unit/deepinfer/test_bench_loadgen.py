"""deepinfer bench's load generator and streaming client against a stand-in OpenAI server (an
httpx transport that streams SSE as a server does): request bodies, conversations that resend the
replies, the concurrency cap, Poisson arrivals, failures."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest

from deepinfer.bench.loadgen import Load, RequestOptions, poisson_offsets, run_load
from deepinfer.bench.workloads import Lengths, build


class FakeServer:
    """Streams ``max_tokens`` token events ("t0 ", "t1 ", ...; the first ``reasoning`` of them as
    reasoning_content) then a usage chunk; a request whose last message contains ``FAIL`` gets an
    HTTP 500."""

    def __init__(self, gap_s: float = 0.002, reasoning: int = 0) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = self.max_in_flight = 0
        self.gap_s, self.reasoning = gap_s, reasoning

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        if "FAIL" in body["messages"][-1]["content"]:
            return httpx.Response(500, text="boom")
        return httpx.Response(200, content=self.events(body), headers={"content-type": "text/event-stream"})

    async def events(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            for i in range(body["max_tokens"]):
                await asyncio.sleep(self.gap_s)
                key = "reasoning_content" if i < self.reasoning else "content"
                chunk = {"choices": [{"index": 0, "delta": {key: f"t{i} "}}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            prompt = sum(len(m["content"].split()) for m in body["messages"])
            usage = {"prompt_tokens": prompt, "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()
        finally:
            self.in_flight -= 1


def client(server: FakeServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(server.handle), base_url="http://server/v1")


async def run(
    server: FakeServer, workload: str, load: Load, n: int, **kw: Any
) -> tuple[list[Any], list[int]]:
    sessions = build(workload, n, Lengths(5, 5), Lengths(3, 3), seed=0, **kw)
    done: list[int] = []
    async with client(server) as http:
        outcomes, _ = await run_load(http, sessions, load, RequestOptions("m"), done.append)
    return outcomes, done


async def test_a_synthetic_request_streams_with_usage_and_ignore_eos() -> None:
    server = FakeServer()
    outcomes, done = await run(server, "synthetic", Load(concurrency=2), 3)
    assert sum(done) == 3 and [o.error for o in outcomes] == [None] * 3
    body = server.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["model"], body["max_tokens"], body["ignore_eos"]) == ("m", 3, True)
    assert "prediction" not in body
    o = outcomes[0]
    assert (o.num_tokens, o.prompt_tokens, o.text) == (3, 5, "t0 t1 t2 ")
    assert len(o.itls_s) == 2 and o.ttft_s is not None and 0 < o.ttft_s <= o.latency_s


async def test_reasoning_deltas_are_timed_but_not_resent() -> None:
    server = FakeServer(reasoning=2)
    outcomes, _ = await run(server, "agent", Load(concurrency=1), 2, turns=2)
    assert [len(o.content_times) for o in outcomes] == [3, 3]  # 2 reasoning + 1 content event each
    assert outcomes[0].text == "t2 "
    assert server.bodies[1]["messages"][2] == {"role": "assistant", "content": "t2 "}


async def test_concurrency_caps_the_streams_in_flight() -> None:
    server = FakeServer(gap_s=0.01)
    await run(server, "synthetic", Load(concurrency=3), 12)
    assert server.max_in_flight == 3


async def test_agent_turns_resend_the_conversation_with_the_replies() -> None:
    server = FakeServer()
    outcomes, _ = await run(server, "agent", Load(concurrency=1), 3, turns=3)
    assert len(outcomes) == 3
    roles = [[m["role"] for m in body["messages"]] for body in server.bodies]
    assert roles[-1] == ["system", "user", "assistant", "user", "assistant", "user"]
    last = server.bodies[-1]["messages"]
    assert last[2]["content"] == last[4]["content"] == "t0 t1 t2 "
    assert last[:4] == server.bodies[1]["messages"]  # each turn extends the one before
    assert [o.prompt_tokens for o in outcomes] == sorted(o.prompt_tokens for o in outcomes)


async def test_code_edit_sends_a_predicted_output() -> None:
    server = FakeServer()
    await run(server, "code-edit", Load(concurrency=1), 1, prediction=True)
    prediction = server.bodies[0]["prediction"]
    assert prediction["type"] == "content" and prediction["content"].startswith("```html")


async def test_a_failed_turn_fails_the_rest_of_its_conversation_unsent() -> None:
    server = FakeServer()
    sessions = build("agent", 3, Lengths(2, 2), Lengths(2, 2), seed=0, turns=3)
    first = sessions[0].turns[0]
    sessions[0] = type(sessions[0])((type(first)("FAIL", 2), *sessions[0].turns[1:]), sessions[0].system)
    done: list[int] = []
    async with client(server) as http:
        outcomes, _ = await run_load(http, sessions, Load(concurrency=1), RequestOptions("m"), done.append)
    assert len(server.bodies) == 1 and sum(done) == 3
    assert outcomes[0].error is not None and outcomes[0].error.startswith("HTTP 500")
    assert all(o.error is not None and "not sent" in o.error for o in outcomes[1:])


async def test_a_request_rate_spreads_the_arrivals() -> None:
    server = FakeServer(gap_s=0.0)
    sessions = build("synthetic", 6, Lengths(1, 1), Lengths(1, 1), seed=0)
    async with client(server) as http:
        _, duration = await run_load(
            http, sessions, Load(request_rate=50.0), RequestOptions("m"), lambda n: None
        )
    assert duration >= poisson_offsets(6, 50.0, np.random.default_rng(0))[-1]


def test_poisson_offsets_start_at_zero_and_have_the_mean_rate() -> None:
    offsets = poisson_offsets(20_001, 4.0, np.random.default_rng(7))
    assert offsets[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(offsets))
    assert offsets[-1] / 20_000 == pytest.approx(0.25, rel=0.03)
    assert offsets == poisson_offsets(20_001, 4.0, np.random.default_rng(7))


def test_a_load_is_one_of_the_two() -> None:
    with pytest.raises(ValueError):
        Load()
    with pytest.raises(ValueError):
        Load(concurrency=1, request_rate=1.0)
    with pytest.raises(ValueError):
        Load(concurrency=0)
    for rate in (0.0, float("inf")):
        with pytest.raises(ValueError):
            Load(request_rate=rate)
    assert Load(request_rate=2.5).label == "rate 2.5/s" and Load(concurrency=8).label == "concurrency 8"
