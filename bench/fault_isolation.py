"""What one hostile client costs everybody else, through a running `deepinfer serve`.

    python bench/fault_isolation.py            # ~4 min on 2 idle cores
    python bench/fault_isolation.py --quick    # a smoke run: fewer streams and tokens

1. Bad requests beside canaries: --streams greedy canary streams run while bad requests arrive
   (a token id past the vocabulary, a bad stop token id, a NaN-like number, a lone surrogate, a
   body nested 5000 deep). Reported: canary streams lost (must be 0), canaries that differ from
   the same streams run alone (fp32, greedy), the bad requests' statuses (no 5xx), and whether
   the worker's pid changed.
2. Inter-token latency while a hostile grammar compiles: the same canaries, once alone and once
   while regexes whose outlines-core index explodes are sent (each a new regex, so no cache
   helps); the stack runs `--grammar-backend outlines` and the gateway's compile check kills each
   at --compile-timeout-s. Baseline: the same streams without the hostile requests, same run;
   ratio = median inter-token latency with / without (1.0: unaffected).
3. A long conversation (625 short messages, ~6.5k prompt tokens) beside the canaries: canaries lost,
   and whether any service logged a peer as lost or gone meanwhile (membership must not lapse
   because a process is busy).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from throughput import running_serve

from libs.runtime.settings import resolve_cache_dir

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List some facts about the moon.",
    "Describe a walk through a forest in autumn.",
    "What makes a good cup of tea?",
    "Tell me about the history of paper.",
]


@dataclass
class Canary:
    text: str
    gaps_s: list[float]  # between consecutive content deltas
    error: str = ""


async def canary(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> Canary:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
    }
    parts: list[str] = []
    stamps: list[float] = []
    try:
        async with http.stream("POST", "/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                return Canary("", [], f"HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Canary("".join(parts), [], f"error event: {event['error']}")
                for choice in event.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        parts.append(piece)
                        stamps.append(time.perf_counter())
    except httpx.HTTPError as exc:
        return Canary("".join(parts), [], f"{type(exc).__name__}: {exc}")
    return Canary("".join(parts), [b - a for a, b in itertools.pairwise(stamps)])


BAD_BODIES: list[tuple[str, str, bytes]] = [
    (
        "/completions",
        "token id past the vocabulary",
        json.dumps({"model": MODEL, "prompt": [49152]}).encode(),
    ),
    (
        "/chat/completions",
        "bad stop_token_ids",
        json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [-1]}
        ).encode(),
    ),
    ("/chat/completions", "NaN temperature", b'{"model": "m", "messages": [], "temperature": NaN}'),
    (
        "/chat/completions",
        "lone surrogate",
        b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
    ),
    (
        "/chat/completions",
        "nested 5000 deep",
        b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    ),
]


def hostile_regex(i: int) -> dict[str, Any]:
    """A regex whose DFA has ~2**22 states, spelled differently each time (no cache hit)."""
    a, b = "abcdefghij"[i % 10], "klmnopqrst"[(i // 10) % 10]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 8,
        "response_format": {"type": "regex", "regex": f"[{a}{b}]*{a}[{a}{b}]{{22}}"},
    }


async def canaries(base_url: str, n: int, max_tokens: int) -> list[Canary]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        return list(
            await asyncio.gather(*(canary(http, PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(n)))
        )


async def with_bad_requests(base_url: str, n: int, max_tokens: int) -> tuple[list[Canary], list[str]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        running = asyncio.gather(*(canary(http, PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(n)))
        await asyncio.sleep(0.5)
        statuses = []
        for path, what, raw in BAD_BODIES:
            resp = await http.post(path, content=raw, headers={"content-type": "application/json"})
            statuses.append(f"{what}: {resp.status_code}")
        return list(await running), statuses


async def with_hostile_compiles(
    base_url: str, n: int, max_tokens: int
) -> tuple[list[Canary], list[tuple[int, float, str]]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        running = asyncio.ensure_future(
            asyncio.gather(*(canary(http, PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(n)))
        )
        hostile: list[tuple[int, float, str]] = []
        i = 0
        while not running.done():
            start = time.perf_counter()
            resp = await http.post("/chat/completions", json=hostile_regex(i))
            message = resp.json().get("error", {}).get("message", "")[:90]
            hostile.append((resp.status_code, time.perf_counter() - start, message))
            i += 1
        return list(await running), hostile


async def with_long_conversation(base_url: str, n: int, max_tokens: int) -> tuple[list[Canary], int]:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"hi {i}"} for i in range(625)]
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        running = asyncio.gather(*(canary(http, PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(n)))
        resp = await http.post("/chat/completions", json=body)
        return list(await running), resp.status_code


def median_gap_ms(runs: list[Canary]) -> float:
    gaps = [g for c in runs for g in c.gaps_s]
    return statistics.median(gaps) * 1e3 if gaps else float("nan")


def worker_pid(serve_pid: int) -> int | None:
    for proc in psutil.Process(serve_pid).children(recursive=True):
        if "deepinfer worker" in " ".join(proc.cmdline()):
            return int(proc.pid)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--compile-timeout-s", type=float, default=5.0)
    parser.add_argument("--quick", action="store_true", help="2 streams of 24 tokens: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.max_tokens = 2, 24
    flags = {
        "--grammar-backend": "outlines",
        "--grammar-compile-timeout-s": str(args.compile_timeout_s),
        "--kv-cache-gb": "0.5",
        "--dtype": "float32",  # exact: a canary beside bad requests must equal its answer alone
        "--cache-dir": resolve_cache_dir("", os.environ),
        "--log-level": "warning",
    }
    with tempfile.TemporaryDirectory() as tmp, running_serve(flags, Path(tmp) / "serve.log") as (url, proc):
        alone = asyncio.run(canaries(url, args.streams, args.max_tokens))
        pid_before = worker_pid(proc.pid)
        beside_bad, statuses = asyncio.run(with_bad_requests(url, args.streams, args.max_tokens))
        beside_hostile, hostile = asyncio.run(with_hostile_compiles(url, args.streams, args.max_tokens))
        again = asyncio.run(canaries(url, args.streams, args.max_tokens))
        pid_after = worker_pid(proc.pid)
        beside_long, long_status = asyncio.run(with_long_conversation(url, args.streams, args.max_tokens))
        log_text = (Path(tmp) / "serve.log").read_text(errors="replace")
    lapses = [line for line in log_text.splitlines() if " lost" in line or " is gone" in line]
    lost = [c.error for c in beside_bad + beside_hostile if c.error]
    print(f"1. bad requests beside {args.streams} canary streams")
    for line in statuses:
        print(f"   {line}")
    print(f"   canary streams lost: {len([c for c in beside_bad if c.error])} (must be 0)")
    differ = sum(c.text != a.text for c, a in zip(beside_bad, alone, strict=True))
    print(f"   canaries differing from the same streams alone (fp32, greedy): {differ}")
    print(f"   worker pid unchanged: {pid_before == pid_after} ({pid_before} -> {pid_after})")
    print(f"2. inter-token latency, {args.streams} streams x {args.max_tokens} tokens")
    base, loaded, after = median_gap_ms(alone), median_gap_ms(beside_hostile), median_gap_ms(again)
    print(f"   alone (baseline):            {base:7.1f} ms")
    print(f"   beside hostile compiles:     {loaded:7.1f} ms   ratio {loaded / base:.2f}x")
    print(f"   alone again:                 {after:7.1f} ms   ratio {after / base:.2f}x")
    statuses_h = sorted({code for code, _, _ in hostile})
    each_s = statistics.median(t for _, t, _ in hostile) if hostile else 0.0
    print(f"   hostile requests: {len(hostile)}, statuses {statuses_h}, each {each_s:.1f} s")
    if hostile:
        print(f"   e.g. {hostile[0][2]!r}")
    print("3. a 625-message conversation (~6.5k tokens) beside the canaries")
    print(f"   its status: {long_status}; canary streams lost: {sum(bool(c.error) for c in beside_long)}")
    print(f"   peers logged as lost or gone: {len(lapses)} {lapses[:2]}")
    lost += [c.error for c in beside_long if c.error]
    if lost:
        print(f"   PROBLEMS: {lost[:3]}")


if __name__ == "__main__":
    main()
