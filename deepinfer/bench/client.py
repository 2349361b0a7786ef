"""One streaming Chat Completions request against any OpenAI-compatible server, timed event by event."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

# A reasoning model's thinking streams under one of these delta keys (DeepSeek's and this stack's
# spelling, vLLM's): generated tokens as much as content is, so they time TTFT and ITL too.
REASONING_KEYS = ("reasoning_content", "reasoning")


@dataclass(frozen=True, slots=True)
class StreamOutcome:
    """What one request came back with, and when (``time.perf_counter()`` values)."""

    num_tokens: int  # completion tokens: the usage chunk's, else one per token event
    ttft_s: float | None  # from the ``start`` the caller gave to the first token event
    error: str | None
    usage: dict[str, Any] | None = None  # the usage chunk, when the stream sent one
    start: float = 0.0
    content_times: tuple[float, ...] = ()  # arrival of each token event: content or reasoning
    end: float = 0.0  # when the stream ended (its last event, or the error)
    text: str = ""  # the content deltas joined: the assistant's reply, without its reasoning

    @property
    def itls_s(self) -> tuple[float, ...]:
        """Gaps between consecutive token events (a server that sends several tokens in one
        event counts as one gap, as ``vllm bench serve`` counts it)."""
        return tuple(b - a for a, b in itertools.pairwise(self.content_times))

    @property
    def latency_s(self) -> float:
        return self.end - self.start

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens") or 0) if self.usage else 0

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the server served from its prefix cache, where it reports them."""
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)


def not_sent(error: str) -> StreamOutcome:
    """The outcome of a request that was never sent (``error`` says why)."""
    now = time.perf_counter()
    return StreamOutcome(0, None, error, start=now, end=now)


async def stream_chat(
    http: httpx.AsyncClient,
    body: dict[str, Any],
    start: float,
    on_event: Callable[[dict[str, Any], float], None] | None = None,
    *,
    require_usage: bool = True,
) -> StreamOutcome:
    """POST ``body`` (without stream flags) to ``/chat/completions`` as a stream with usage asked
    for. ``start`` is the time TTFT counts from (a level's common start, or the request's own).
    ``on_event`` gets each event and the ``time.perf_counter()`` it arrived at. With
    ``require_usage``, a stream that ends without a usage chunk is an error; without it, tokens
    are counted one per token event."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    times: list[float] = []
    parts: list[str] = []
    usage: dict[str, Any] | None = None

    def outcome(error: str | None) -> StreamOutcome:
        # a failed request's tokens count nowhere: callers sum num_tokens over every outcome
        num_tokens = int(usage.get("completion_tokens") or 0) if usage else len(times)
        num_tokens = 0 if error else num_tokens
        ttft = times[0] - start if times else None
        end = time.perf_counter()
        return StreamOutcome(num_tokens, ttft, error, usage, start, tuple(times), end, "".join(parts))

    for attempt in range(2):
        answered = False
        try:
            async with http.stream("POST", "/chat/completions", json=body) as resp:
                answered = True
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    return outcome(f"HTTP {resp.status_code}: {text[:300]}")
                usage, error = await _read_events(resp, on_event, times, parts)
                if error is not None:
                    return outcome(error)
        except httpx.RemoteProtocolError as exc:
            # A kept-alive connection the server had closed (llama-server closes idle ones): the
            # request never reached it, and is sent once more on a fresh connection.
            if attempt == 0 and not answered:
                continue
            return outcome(f"{type(exc).__name__}: {exc}")
        except httpx.HTTPError as exc:
            return outcome(f"{type(exc).__name__}: {exc}")
        break
    if usage is None and require_usage:
        return outcome("stream ended without a usage chunk")
    return outcome(None)


async def _read_events(
    resp: httpx.Response,
    on_event: Callable[[dict[str, Any], float], None] | None,
    times: list[float],
    parts: list[str],
) -> tuple[dict[str, Any] | None, str | None]:
    """Read a chat stream's events: each token event's time into ``times``, its text into
    ``parts``; returns the usage chunk (None: none came) and the error event's text (None)."""
    usage: dict[str, Any] | None = None
    async for line in resp.aiter_lines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        now = time.perf_counter()
        if on_event is not None:
            on_event(event, now)
        if "error" in event:
            return usage, f"error event in stream: {json.dumps(event['error'])[:300]}"
        deltas = [c.get("delta") or {} for c in event.get("choices") or ()]
        content = "".join(d.get("content") or "" for d in deltas)
        if content or any(d.get(key) for d in deltas for key in REASONING_KEYS):
            times.append(now)
        parts.append(content)
        usage = event.get("usage") or usage
    return usage, None


def open_client(base_url: str, api_key: str = "", timeout_s: float = 600.0) -> httpx.AsyncClient:
    """A client for ``base_url`` (ending in /v1) with no cap on connections: the load decides how
    many streams are open, not the pool (httpx's default would queue past 100)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s, limits=limits)


async def first_model(http: httpx.AsyncClient) -> str:
    """The first model ``GET /models`` lists: the one to load when none is named."""
    resp = await http.get("/models")
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"{http.base_url}models lists no model; name one with --model")
    return str(models[0]["id"])
