"""bench/fleet.py, part pd: decode latency under long-prompt interference, 1 prefill + 1 decode
worker (P/D) against 2 colocated workers, both on a fresh `deepinfer serve` with G3 on.

--pd-streams streams decode (short prompts, greedy); once every one has its first token, --pd-long
prompts of about --pd-long-tokens tokens arrive --pd-long-every-s apart. The figure is the
inter-token latency of the decoding streams (the gaps between their content deltas) from the
first long prompt's arrival until the last one has its answer: p50 and p99, P/D over colocated.
Both stacks route round robin: in the colocated one every worker then decodes half the streams and
prefills half the long prompts, as colocation means. (With KV routing, the short streams' shared
chat-template blocks, cached on the first worker to take one, drew every stream there, the long
prompts went to the idle other worker, and the baseline became a disaggregated stack by accident.)
Each worker is pinned to a core of its own (every thread of it, as taskset -a would, once serve is
up), so the two workers do not share a core; the scheduler, gateway, kvcache and nats-server
share both. On one machine this measures batching interference (a decode step waiting behind a
prefill chunk), not separate devices.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from fleet_report import ms, percentile, ratio, target_row
from throughput import fmt_ratio, print_table, running_serve, stream_chat

TARGET_ITL_P99 = 0.5  # pd / colocated, at most
TOPOLOGIES = {  # the baseline first
    "colocated": {"--num-workers": "2", "--routing": "round_robin"},
    "pd": {"--prefill-workers": "1", "--decode-workers": "1", "--routing": "round_robin"},
}


@dataclass(frozen=True, slots=True)
class PDOptions:
    model: str
    dtype: str
    cache_dir: str
    num_streams: int
    stream_tokens: int  # at most; the streams are stopped once the window closes
    num_long: int
    long_tokens: int  # about: the prompt is built to this size in words
    long_every_s: float
    kv_cache_gb: float


@dataclass(slots=True)
class PDResult:
    topology: str
    itl_s: list[float] = field(default_factory=list)  # in the window
    long_ttft_s: list[float] = field(default_factory=list)
    long_prompt_tokens: int = 0
    window_s: float = 0.0
    pinned: dict[str, int] = field(default_factory=dict)  # worker id -> core
    errors: list[str] = field(default_factory=list)

    def itl(self, q: float) -> float | None:
        return percentile(self.itl_s, q)


def long_prompt(i: int, num_tokens: int) -> str:
    """About ``num_tokens`` tokens of log lines (about 16 tokens each in SmolLM2's vocabulary),
    distinct per ``i``."""
    lines = (f"Log {i}.{n}: sensor {n % 7} read {(n * 13 + i) % 97}." for n in range(num_tokens // 16))
    return " ".join(lines) + " Summarize the log in one line."


def pin_workers(serve: subprocess.Popen[bytes]) -> dict[str, int]:
    """Each worker process of ``serve`` (every thread of it) to a core of its own, in id order;
    returns worker id -> core."""
    workers: dict[str, int] = {}  # worker id -> pid
    for proc in psutil.Process(serve.pid).children(recursive=True):
        argv = proc.cmdline()
        if argv[3:4] == ["worker"]:  # python -m deepinfer worker ...
            workers[argv[argv.index("--worker-id") + 1]] = proc.pid
    pinned = dict(zip(sorted(workers), sorted(os.sched_getaffinity(0)), strict=False))
    for worker_id, core in pinned.items():
        for thread in psutil.Process(workers[worker_id]).threads():  # as taskset -a: every thread
            os.sched_setaffinity(thread.id, {core})
    return pinned


async def decode_stream(
    http: httpx.AsyncClient, opts: PDOptions, i: int, gaps: Callable[[float], None], first: asyncio.Event
) -> None:
    body = {
        "model": opts.model,
        "messages": [{"role": "user", "content": f"Count slowly from {i} upwards, one number per line."}],
        "max_tokens": opts.stream_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    last: list[float] = []

    def on_event(event: dict[str, Any], now: float) -> None:
        if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
            if last:
                gaps(now - last[0])
            last[:] = [now]
            first.set()

    await stream_chat(http, body, time.perf_counter(), on_event)


async def run_topology(opts: PDOptions, topology: str, tmp: Path) -> PDResult:
    result = PDResult(topology)
    flags = {
        **TOPOLOGIES[topology],
        "--model": opts.model,
        "--dtype": opts.dtype,
        "--num-threads": "1",
        "--max-num-seqs": str(opts.num_streams + opts.num_long + 4),
        "--kv-cache-gb": str(opts.kv_cache_gb),
        "--host-cache-gb": "0.25",
        "--kv-store-path": str(tmp / f"kv-store-{topology}"),
        "--pd-min-uncached-tokens": "1024",
        "--pd-max-prefill-queue": str(opts.num_long + 1),  # every long prompt may go to the prefill worker
        "--cache-dir": opts.cache_dir,
        "--log-level": "warning",
    }
    with running_serve(flags, tmp / f"serve-{topology}.log", f"the {topology} stack") as (url, proc):
        result.pinned = pin_workers(proc)
        window: list[float] = []  # [start, end] of the interference window

        def gap(seconds: float) -> None:
            now = time.perf_counter()
            if window and now >= window[0] and (len(window) == 1 or now <= window[1]):
                result.itl_s.append(seconds)

        limits = httpx.Limits(max_connections=opts.num_streams + opts.num_long + 8)
        async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as http:
            firsts = [asyncio.Event() for _ in range(opts.num_streams)]
            streams = [
                asyncio.create_task(decode_stream(http, opts, i, gap, e)) for i, e in enumerate(firsts)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 600)
            window.append(time.perf_counter())
            longs = []
            for i in range(opts.num_long):
                body = {
                    "model": opts.model,
                    "messages": [{"role": "user", "content": long_prompt(i, opts.long_tokens)}],
                    "max_tokens": 4,
                    "temperature": 0,
                }
                longs.append(asyncio.create_task(stream_chat(http, body, time.perf_counter())))
                await asyncio.sleep(opts.long_every_s)
            for outcome in await asyncio.gather(*longs):
                if outcome.error is not None:
                    result.errors.append(f"{topology}, long prompt: {outcome.error}")
                if outcome.ttft_s is not None:
                    result.long_ttft_s.append(outcome.ttft_s)
                if outcome.usage is not None:
                    result.long_prompt_tokens = int(outcome.usage["prompt_tokens"])
            window.append(time.perf_counter())
            result.window_s = window[1] - window[0]
            if any(s.done() for s in streams):
                why = "a decode stream ended inside the window (raise --pd-stream-tokens)"
                result.errors.append(f"{topology}: {why}")
            for s in streams:
                s.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*streams, return_exceptions=True)
    return result


async def run_pd(opts: PDOptions, tmp: Path, progress: Callable[[str], None]) -> dict[str, PDResult]:
    results = {}
    for topology in TOPOLOGIES:
        progress(f"pd part: {topology} stack")
        results[topology] = await run_topology(opts, topology, tmp)
    return results


def median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.0f}" if values else "n/a"


def report_pd(opts: PDOptions, results: dict[str, PDResult], summary: list[list[str]]) -> None:
    rows = [
        [r.topology, " ".join(f"{w}:cpu{c}" for w, c in r.pinned.items()), str(r.long_prompt_tokens),
         median_ms(r.long_ttft_s), f"{r.window_s:.0f}", str(len(r.itl_s)), ms(r.itl(0.5)), ms(r.itl(0.99))]
        for r in results.values()
    ]  # fmt: skip
    print_table(
        f"pd: {opts.num_streams} streams decoding while {opts.num_long} long prompts arrive "
        f"{opts.long_every_s:g} s apart; workers pinned to a core each, the other services share the cores",
        ["topology", "pinned", "long prompt tokens", "long TTFT p50 ms", "window s", "ITL samples",
         "ITL p50 ms", "ITL p99 ms"],
        rows,
    )  # fmt: skip
    base, pd = results.get("colocated"), results.get("pd")
    if base is None or pd is None:
        return
    p99 = ratio(pd.itl(0.99), base.itl(0.99))
    print(f"ratio pd/colocated decode ITL p99: {fmt_ratio(p99)} (target <= {TARGET_ITL_P99}x)")
    summary.append(target_row("pd/colocated decode ITL p99", p99, TARGET_ITL_P99, at_least=False))
    summary.append(["pd/colocated decode ITL p50", "-", fmt_ratio(ratio(pd.itl(0.5), base.itl(0.5))), "-"])
