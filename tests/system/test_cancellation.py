"""A client that disconnects mid-stream: its sequence leaves the worker once the resume grace is over."""

from __future__ import annotations

import asyncio
import time

import httpx
import nats

from libs.protocol.codec import decode
from libs.protocol.messages import WorkerLoad
from libs.protocol.subjects import Subjects
from tests.system.stack import RESUME_GRACE_S, Stack

MODEL = "SmolLM2-135M-Instruct"


def test_disconnect_frees_the_sequence_on_the_worker(stack: Stack) -> None:
    async def run() -> float:
        nc = await nats.connect(stack.nats.url)
        loads: asyncio.Queue[tuple[float, WorkerLoad]] = asyncio.Queue()

        async def on_load(msg: nats.aio.msg.Msg) -> None:
            loads.put_nowait((time.monotonic(), decode(WorkerLoad, msg.data)))

        await nc.subscribe(Subjects().load(stack.worker_id), cb=on_load)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Write a very long story."}],
            "max_tokens": 2000,
            "stream": True,
            "temperature": 0.7,
            "seed": 1,
        }
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http:
            async with http.stream("POST", "/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                num_chunks = 0
                async for line in resp.aiter_lines():
                    num_chunks += line.startswith("data: ")
                    if num_chunks >= 5:
                        break
                # the sequence is running on the worker right now
                while (await asyncio.wait_for(loads.get(), 5))[1].num_running_seqs == 0:
                    pass
            closed_at = time.monotonic()  # leaving the block closes the connection
        while True:  # fails by timeout if the count never returns to zero
            seen_at, load = await asyncio.wait_for(loads.get(), 10)
            if load.num_running_seqs == 0:
                await nc.close()
                return seen_at - closed_at

    # Kept for a resume during the grace period, then cancelled everywhere.
    assert RESUME_GRACE_S <= asyncio.run(run()) < RESUME_GRACE_S + 10
