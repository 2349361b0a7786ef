"""The whole stack against llama.cpp's `llama-server` on the same GGUF, under the same OpenAI load.

    LLAMA_SERVER=/path/to/llama-server python bench/vs_llama_server.py [--concurrency 1,8,32]
    python bench/vs_llama_server.py --quick      # the stack alone, one short level (no llama-server)

Both serve SmolLM2's Q4_1 GGUF; llama-server with `-t THREADS -np MAX --cont-batching`, the stack
(`deepinfer serve`) with `--num-threads THREADS` and the weight format `--dtype`. Each level sends
N concurrent streaming Chat Completions (distinct prompts, `--max-tokens` each with `ignore_eos`,
temperature `--temperature`, a seed per stream) after a warm-up round, `--repeats` times; the run
with the most tokens/s counts. Printed per level and server: tokens/s (generated tokens over the
wall time from the first request to the last token), TTFT p50/p99, inter-token latency p50/p99
(gaps between a stream's content events), computed as `deepinfer bench` computes them (the
streaming client and metrics of deepinfer/bench/), and the stack/llama-server ratios, then the targets:
tokens/s 1.0x at 1 stream, 1.5x at 8, 2.0x at 32, and for each server its first request's TTFT
against the median TTFT of the single requests after it (target <= 2x): the first request after
start, which pays for any warm-up the server did not do.

Building llama-server (CPU, about 7 minutes on 2 cores), from the llama.cpp sources vendored in
the llama-cpp-python 0.3.36 sdist:
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
    tar xzf llama_cpp_python-0.3.36.tar.gz && cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build --target llama-server -j2
    export LLAMA_SERVER=$PWD/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prompts import bench_prompts
from throughput import load_average, running_serve, running_server

from deepinfer.bench.client import StreamOutcome, stream_chat
from deepinfer.bench.metrics import summarize
from libs.bus.nats_server import free_port
from libs.modelfiles.registry import resolve_model_path
from libs.runtime.settings import resolve_cache_dir

TARGETS = {1: 1.0, 8: 1.5, 32: 2.0}  # stack / llama-server tokens/s
TARGET_FIRST_TTFT = 2.0  # first request's TTFT / median TTFT
NUM_SINGLE_AFTER_FIRST = 5  # single requests whose median the first one is held against


@dataclass(frozen=True, slots=True)
class Level:
    num_streams: int
    metrics: dict[str, Any]  # deepinfer.bench.metrics.summarize's: vllm bench serve's names
    errors: tuple[str, ...]

    @property
    def tokens_per_s(self) -> float:
        return float(self.metrics["output_throughput"])


async def stream(http: httpx.AsyncClient, body: dict[str, Any]) -> StreamOutcome:
    """One streaming chat, TTFT from its own start; tokens from the usage chunk when the server
    sends one, else one per content event."""
    return await stream_chat(http, body, time.perf_counter(), require_usage=False)


def request(prompt: str, max_tokens: int, temperature: float, seed: int) -> dict[str, Any]:
    return {
        "model": "smollm2",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "ignore_eos": True,
    }


async def run_level(base_url: str, prompts: list[str], opts: argparse.Namespace) -> Level:
    """A warm-up round, then the prompts as concurrent streams ``repeats`` times; the best run."""
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        await asyncio.gather(
            *(stream(http, request(p, 2, opts.temperature, i)) for i, p in enumerate(prompts))
        )
        runs = []
        for _ in range(opts.repeats):
            start = time.perf_counter()
            streams = await asyncio.gather(
                *(
                    stream(http, request(p, opts.max_tokens, opts.temperature, i))
                    for i, p in enumerate(prompts)
                )
            )
            metrics = summarize(streams, time.perf_counter() - start)
            runs.append(Level(len(prompts), metrics, tuple(s.error for s in streams if s.error)))
    return max(runs, key=lambda r: r.tokens_per_s)


async def first_and_after(base_url: str, opts: argparse.Namespace) -> tuple[float | None, float | None]:
    """TTFT of the first request a fresh server gets, and the median TTFT of single requests after it."""
    prompts = bench_prompts(NUM_SINGLE_AFTER_FIRST + 1)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        first = await stream(http, request(prompts[0], 8, opts.temperature, 0))
        after = [await stream(http, request(p, 8, opts.temperature, 0)) for p in prompts[1:]]
    ttfts = [s.ttft_s for s in after if s.ttft_s is not None]
    return first.ttft_s, statistics.median(ttfts) if ttfts else None


@contextlib.contextmanager
def running_llama_server(binary: str, gguf: Path, opts: argparse.Namespace, log: Path) -> Iterator[str]:
    port = free_port()
    slots = max(opts.concurrency)
    argv = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(opts.threads)]
    # Each slot gets ctx / slots positions: room for a prompt and max_tokens with margin.
    argv += ["-np", str(slots), "--cont-batching", "-c", str(slots * (opts.max_tokens + 256))]
    argv += ["--threads-http", str(slots + 4)]
    with running_server(argv, port, log, "llama-server", signal.SIGTERM):
        yield f"http://127.0.0.1:{port}/v1"


def stack_flags(opts: argparse.Namespace, cache_dir: str) -> dict[str, str]:
    return {
        "--dtype": opts.dtype,
        "--num-threads": str(opts.threads),
        "--max-num-seqs": str(max(opts.concurrency)),
        "--cache-dir": cache_dir,
        "--log-level": "warning",
    }


def measure(
    base_url: str, opts: argparse.Namespace
) -> tuple[tuple[float | None, float | None], dict[int, Level]]:
    first = asyncio.run(first_and_after(base_url, opts))
    levels: dict[int, Level] = {}
    for n in opts.concurrency:
        levels[n] = asyncio.run(run_level(base_url, bench_prompts(n), opts))
        print(f"  {n} streams: {levels[n].tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
    return first, levels


def ms(value: float | None) -> str:
    return f"{value * 1e3:.0f}" if value is not None else "-"


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


Results = dict[str, tuple[tuple[float | None, float | None], dict[int, Level]]]


def level_row(name: str, n: int, lv: Level) -> str:
    keys = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
    return f"{name:<14} {n:>7} {lv.tokens_per_s:>7.1f} " + " ".join(f"{lv.metrics[k]:>8.0f}" for k in keys)


def print_report(results: Results) -> None:
    header = ("server", "streams", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99")
    print(
        f"\n{header[0]:<14} {header[1]:>7} {header[2]:>7} "
        + " ".join(f"{h:>8}" for h in header[3:])
        + "  (ms)"
    )
    for name, (_, levels) in results.items():
        for n, lv in levels.items():
            print(level_row(name, n, lv))
            for error in dict.fromkeys(lv.errors):
                print(f"  PROBLEM: {lv.errors.count(error)}x {error}")
    stack, server = results.get("deepinfer"), results.get("llama-server")
    print("\ntargets")
    if stack is not None and server is not None:
        for n, goal in TARGETS.items():
            if n in stack[1] and n in server[1]:
                value = stack[1][n].tokens_per_s / max(server[1][n].tokens_per_s, 1e-9)
                mark = "met" if value >= goal else "MISSED"
                print(f"  tokens/s at {n:>2} streams, stack / llama-server: {value:.2f}x (>= {goal}x) {mark}")
    for name, ((first, median), _) in results.items():
        met = first is not None and median is not None and first / median <= TARGET_FIRST_TTFT
        print(
            f"  {name}: first request's TTFT {ms(first)} ms / median {ms(median)} ms = {ratio(first, median)}"
            f" (target <= {TARGET_FIRST_TTFT}x) {'met' if met else 'MISSED'}"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--llama-server", default=os.environ.get("LLAMA_SERVER", ""), help="path (env LLAMA_SERVER)"
    )
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--dtype", default="auto", help="the stack's weight format (worker --dtype)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache-dir", default="")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: the stack alone, 2 streams, 8 tokens"
    )
    opts = parser.parse_args()
    opts.concurrency = tuple(int(x) for x in opts.concurrency.split(","))
    if opts.quick:
        opts.concurrency, opts.max_tokens, opts.repeats, opts.llama_server = (2,), 8, 1, ""
    return opts


def main() -> None:
    opts = parse_args()
    cache_dir = resolve_cache_dir(opts.cache_dir, os.environ)
    gguf = resolve_model_path("smollm2")
    print(f"SmolLM2 {gguf.name}, {opts.threads} threads, {opts.max_tokens} tokens at temperature "
          f"{opts.temperature}, stack --dtype {opts.dtype}, load {load_average()}")  # fmt: skip
    results: Results = {}
    with tempfile.TemporaryDirectory() as tmp:
        print("deepinfer serve", file=sys.stderr, flush=True)
        with running_serve(stack_flags(opts, cache_dir), Path(tmp) / "serve.log") as (base_url, _):
            results["deepinfer"] = measure(base_url, opts)
        if opts.llama_server:
            print("llama-server", file=sys.stderr, flush=True)
            with running_llama_server(opts.llama_server, gguf, opts, Path(tmp) / "llama.log") as base_url:
                results["llama-server"] = measure(base_url, opts)
        elif not opts.quick:
            print(
                "llama-server: not run (set LLAMA_SERVER or --llama-server; how to build it: the docstring)"
            )
    print_report(results)
    if any(lv.errors for _, levels in results.values() for lv in levels.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
