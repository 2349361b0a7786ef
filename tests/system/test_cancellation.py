"""A client that disconnects: its sequence leaves the worker at once. A stream is paused for the
resume grace period (test_resume checks that it computes nothing and is cancelled after it); a
non-streaming request, which cannot be resumed, is cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import httpx
import nats

from libs.protocol.codec import decode
from libs.protocol.member_messages import WorkerLoad
from libs.protocol.subjects import Subjects
from tests.system.stack import RESUME_GRACE_S, Stack

MODEL = "SmolLM2-135M-Instruct"
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Write a very long story."}],
    "max_tokens": 2000,
    "temperature": 0.7,
    "seed": 1,
}


def seconds_until_freed(stack: Stack, leave: Callable[[httpx.AsyncClient], Awaitable[None]]) -> float:
    """Run ``leave`` (a request the client abandons while its sequence runs); return how long after
    it returned the worker reported no running sequence."""

    async def run() -> float:
        nc = await nats.connect(stack.nats.url)
        loads: asyncio.Queue[tuple[float, WorkerLoad]] = asyncio.Queue()

        async def on_load(msg: nats.aio.msg.Msg) -> None:
            loads.put_nowait((time.monotonic(), decode(WorkerLoad, msg.data)))

        await nc.subscribe(Subjects().load(stack.worker_id), cb=on_load)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http:
            await leave(http)
        left_at = time.monotonic()
        ran = False  # the sequence was on the worker before the client left
        while True:  # fails by timeout if the count never returns to zero
            seen_at, load = await asyncio.wait_for(loads.get(), 10)
            ran |= seen_at <= left_at and load.num_running_seqs > 0
            if load.num_running_seqs == 0 and seen_at > left_at:
                await nc.close()
                assert ran
                return seen_at - left_at

    return asyncio.run(run())


def test_a_stream_leaves_the_worker_at_once_paused(stack: Stack) -> None:
    async def leave(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", "/chat/completions", json={**BODY, "stream": True}) as resp:
            assert resp.status_code == 200
            num_chunks = 0
            async for line in resp.aiter_lines():
                num_chunks += line.startswith("data: ")
                if num_chunks >= 5:
                    break  # leaving the block closes the connection

    # Paused: its sequence is off the worker well before the grace period (kept for a resume) ends.
    assert seconds_until_freed(stack, leave) < RESUME_GRACE_S


def test_a_non_streaming_request_is_cancelled_at_once(stack: Stack) -> None:
    async def leave(http: httpx.AsyncClient) -> None:
        with contextlib.suppress(httpx.ReadTimeout):  # the client gives up while it generates
            await http.post("/chat/completions", json=BODY, timeout=httpx.Timeout(60, read=2.0))
            raise AssertionError("2000 tokens came back within 2 s")

    assert seconds_until_freed(stack, leave) < RESUME_GRACE_S
