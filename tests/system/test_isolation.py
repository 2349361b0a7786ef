"""A bad request never takes a batch down: while three greedy streams run, token ids past SmolLM2's
vocabulary get a 400 at the gateway (a prompt, or stop_token_ids), and the same prompt submitted
straight on the bus (past the gateway's check) fails alone in the worker's step. The streams end
equal to their solo answers and the worker process is the one that started."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import nats

from libs.protocol.codec import decode, encode, pack_tokens
from libs.protocol.messages import (
    FinishReason,
    SamplingParams,
    StepOutputs,
    SubmitReply,
    SubmitRequest,
    SubmitStatus,
)
from libs.protocol.subjects import Subjects
from tests.system.stack import Stack

MODEL = "SmolLM2-135M-Instruct"
VOCAB_SIZE = 49152  # SmolLM2's: ids 0..49151
EOS_TOKEN_ID = 2
CANARIES = ["What is the capital of France?", "Name three colours.", "Count from one to ten."]
MAX_TOKENS = 40


def canary_body(prompt: str, stream: bool) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stream": stream,
    }


async def stream_canary(http: httpx.AsyncClient, prompt: str, started: asyncio.Event) -> str:
    pieces = []
    async with http.stream("POST", "/chat/completions", json=canary_body(prompt, True)) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                pieces.append(chunk["choices"][0]["delta"].get("content") or "")
                started.set()
    return "".join(pieces)


async def submit_on_the_bus(stack: Stack, prompt: list[int]) -> tuple[FinishReason | None, str]:
    """Submit as a gateway would, with no gateway's checks; returns how the request finished."""
    nc = await nats.connect(stack.nats.url)
    subjects = Subjects()
    gateway_id, request_id = "gw-direct-" + uuid.uuid4().hex[:6], "direct-" + uuid.uuid4().hex[:6]
    done: asyncio.Future[tuple[FinishReason | None, str]] = asyncio.get_running_loop().create_future()

    async def on_out(msg: nats.aio.msg.Msg) -> None:
        for out in decode(StepOutputs, msg.data).outputs:
            if out.request_id == request_id and out.finish_reason is not None and not done.done():
                done.set_result((out.finish_reason, out.error))

    try:
        await nc.subscribe(subjects.out(gateway_id), cb=on_out)
        params = SamplingParams(temperature=0.0, max_tokens=8)
        req = SubmitRequest(request_id, gateway_id, pack_tokens(prompt), params, EOS_TOKEN_ID)
        reply = decode(SubmitReply, (await nc.request(subjects.submit, encode(req), timeout=30)).data)
        assert reply.status is SubmitStatus.ACCEPTED, reply
        return await asyncio.wait_for(done, 60)
    finally:
        await nc.close()


def test_bad_token_ids_fail_alone_and_the_canaries_finish_as_alone(stack: Stack) -> None:
    worker_pid = stack.procs[1].pid  # kvcache, worker, scheduler, gateway
    solo = [
        httpx.post(f"{stack.base_url}/chat/completions", json=canary_body(p, False), timeout=120)
        for p in CANARIES
    ]
    solo_texts = [r.json()["choices"][0]["message"]["content"] for r in solo]

    async def run_all() -> tuple[list[str], list[httpx.Response], tuple[FinishReason | None, str]]:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
            started = [asyncio.Event() for _ in CANARIES]
            canaries = [
                asyncio.create_task(stream_canary(http, p, s)) for p, s in zip(CANARIES, started, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)  # all three decoding
            bad = await asyncio.gather(
                http.post("/completions", json={"model": MODEL, "prompt": [VOCAB_SIZE], "max_tokens": 4}),
                http.post(
                    "/chat/completions", json={**canary_body("Hi", False), "stop_token_ids": [VOCAB_SIZE]}
                ),
            )
            direct = await submit_on_the_bus(stack, [1, VOCAB_SIZE, 3])  # joins the canaries' batch
            return await asyncio.gather(*canaries), list(bad), direct

    texts, bad, (finish, error) = asyncio.run(run_all())
    for resp, param in zip(bad, ("prompt", "stop_token_ids"), strict=True):
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param and str(VOCAB_SIZE) in resp.json()["error"]["message"]
    assert finish is FinishReason.ERROR and "vocabulary" in error and "worker lost" not in error
    assert len(set(solo_texts)) == len(CANARIES)  # different prompts, different answers
    assert texts == solo_texts
    assert stack.procs[1].pid == worker_pid and stack.procs[1].poll() is None  # the same worker, alive
