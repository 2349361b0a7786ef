"""Send a workload's sessions to a server under one load: a fixed number of sessions in flight, or
sessions arriving as a Poisson process; every request streamed and timed."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from deepinfer.bench.client import StreamOutcome, not_sent, stream_chat
from deepinfer.bench.workloads import Session, Turn


@dataclass(frozen=True, slots=True)
class Load:
    """Exactly one of: ``concurrency`` sessions in flight at a time (all queued at the start), or
    sessions starting at ``request_rate`` per second on average (Poisson, no cap on how many run;
    finite: all at once is a concurrency)."""

    concurrency: int | None = None
    request_rate: float | None = None

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("a load is a concurrency or a request rate, one of the two")
        if (self.concurrency is not None and self.concurrency < 1) or (
            self.request_rate is not None and not 0 < self.request_rate < math.inf
        ):
            raise ValueError(f"a load must be positive: {self}")

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return f"rate {self.request_rate:g}/s"


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """What every request carries besides its messages."""

    model: str
    temperature: float = 0.0
    ignore_eos: bool = True  # a sampling extension: our gateway, vLLM and llama-server take it

    def body(self, messages: list[dict[str, str]], turn: Turn) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": turn.max_tokens,
            "temperature": self.temperature,
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if turn.prediction is not None:
            body["prediction"] = {"type": "content", "content": turn.prediction}
        return body


def poisson_offsets(count: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Start times (s from the run's start) of ``count`` arrivals at ``rate`` per second: the first
    at 0, then exponential gaps of mean 1 / rate."""
    gaps = rng.exponential(1.0 / rate, size=max(count - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:count]


async def run_session(
    http: httpx.AsyncClient, session: Session, opts: RequestOptions, done: Callable[[int], None]
) -> list[StreamOutcome]:
    """The session's turns one after another, each resending the conversation so far with the
    replies the server gave. A failed turn ends the conversation: its later turns count as failed
    without being sent (the conversation they continue does not exist)."""
    messages = [{"role": "system", "content": session.system}] if session.system else []
    outcomes: list[StreamOutcome] = []
    for turn in session.turns:
        messages.append({"role": "user", "content": turn.user})
        outcome = await stream_chat(http, opts.body(messages, turn), time.perf_counter(), require_usage=False)
        outcomes.append(outcome)
        done(1)
        if outcome.error is not None:
            skipped = len(session.turns) - len(outcomes)
            outcomes += [not_sent("not sent: an earlier turn of its conversation failed")] * skipped
            done(skipped)
            break
        messages.append({"role": "assistant", "content": outcome.text})
    return outcomes


async def run_load(
    http: httpx.AsyncClient,
    sessions: list[Session],
    load: Load,
    opts: RequestOptions,
    done: Callable[[int], None],
    seed: int = 0,
) -> tuple[list[StreamOutcome], float]:
    """Every session under ``load``: the outcomes (sessions in order, turns in order) and the run's
    wall time, from the first send to the last stream's end. ``done(n)``: n more requests ended."""
    gate = asyncio.Semaphore(load.concurrency or len(sessions) or 1)
    offsets = (
        poisson_offsets(len(sessions), load.request_rate, np.random.default_rng(seed))
        if load.request_rate is not None
        else [0.0] * len(sessions)
    )
    start = time.perf_counter()

    async def one(session: Session, offset: float) -> list[StreamOutcome]:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        async with gate:
            return await run_session(http, session, opts, done)

    results = await asyncio.gather(*(one(s, t) for s, t in zip(sessions, offsets, strict=True)))
    return [o for outcomes in results for o in outcomes], time.perf_counter() - start
