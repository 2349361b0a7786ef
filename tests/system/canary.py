"""Canary streams: greedy chat requests run beside a test, round after round, whose answers must
equal the answers each got alone first. A bad request that hurt a neighbour (a sequence failed,
a batch corrupted, the worker restarted) shows up as a canary that differs or fails."""

from __future__ import annotations

import asyncio
import json
import threading
from types import TracebackType

import httpx

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "Count from one to twenty in words.",
    "Name the planets of the solar system, one per line.",
    "Write a short poem about rain.",
]
MAX_TOKENS = 48


def _body(prompt: str, stream: bool) -> dict[str, object]:
    messages = [{"role": "user", "content": prompt}]
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    }


async def _streamed(http: httpx.AsyncClient, prompt: str, started: threading.Event) -> str:
    """The text of one streamed answer; raises on a non-200, an error chunk or a missing [DONE]."""
    parts, done = [], False
    async with http.stream("POST", "/chat/completions", json=_body(prompt, True)) as resp:
        if resp.status_code != 200:
            raise AssertionError(f"{resp.status_code}: {(await resp.aread())[:300]!r}")
        started.set()
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise AssertionError(f"error chunk: {chunk['error']}")
            parts += [c["delta"].get("content") or "" for c in chunk["choices"]]
    if not done:
        raise AssertionError(f"no [DONE] after {len(parts)} chunks")
    return "".join(parts)


class Canaries:
    """``with Canaries(base_url) as canaries:`` runs rounds until the block ends; then ``check()``."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        with httpx.Client(base_url=base_url, timeout=120) as http:  # alone, one at a time
            self.solo = [
                http.post("/chat/completions", json=_body(p, False)).json()["choices"][0]["message"][
                    "content"
                ]
                for p in PROMPTS
            ]
        self.num_rounds = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._started = threading.Event()  # a canary stream is running: the test may begin
        self._thread = threading.Thread(target=lambda: asyncio.run(self._rounds()), daemon=True)

    def __enter__(self) -> Canaries:
        self._thread.start()
        if not self._started.wait(60):
            self.__exit__(None, None, None)
            raise AssertionError(f"no canary stream started: {self.failures[:3]}")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()

    async def _rounds(self) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=120) as http:
            while not self._stop.is_set():
                answers = await asyncio.gather(
                    *(_streamed(http, p, self._started) for p in PROMPTS), return_exceptions=True
                )
                for prompt, solo, got in zip(PROMPTS, self.solo, answers, strict=True):
                    if isinstance(got, BaseException):
                        self.failures.append(f"round {self.num_rounds} {prompt!r}: {got!r}")
                    elif got != solo:
                        self.failures.append(f"round {self.num_rounds} {prompt!r}: {got!r} != solo {solo!r}")
                self.num_rounds += 1

    def check(self) -> None:
        assert self.num_rounds >= 1, "no canary round ran beside the test"
        assert not self.failures, self.failures[:5]
