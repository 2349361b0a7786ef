"""bench/fleet.py --part migration: kill -9 of the worker holding streams, to each moved stream's
next token, over several kills; the baseline is the same streams' inter-token latency before it.

Two workers under one scheduler, each service its own process (fleet_stack.ProcessFleet). A round
starts a few greedy streams (EOS ignored), waits until each has tokens, and finds the busiest worker
from the ``load.*`` reports (``num_running_seqs``). The streams on it are those whose sequence the
plans gave it (PlanTap, closed before the kill). Right after one of them gets a token, plus a
quarter of its inter-token latency so that token's step has reached every stream, that worker gets
SIGKILL: no token of its is in flight then. Each moved stream's time to its next content delta is
measured from there. Every stream must then complete (``max_tokens`` tokens, no error event).
A replacement worker (a new ``--worker-id``) starts and is waited for until a scheduler drives it.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fleet_report import ms, ratio
from fleet_stack import PlanTap, ProcessFleet, wait_driven, worker_loads
from prompts import bench_prompts
from throughput import fmt_ratio, log_tail, print_table, stream_chat

from deepinfer.serve import ChildExited, wait_healthy
from libs.bus.nats_server import EmbeddedNatsServer

MIN_TOKENS_BEFORE_KILL = 8
READY_TIMEOUT_S = 600.0
ROUND_TIMEOUT_S = 300.0  # one round's streams, kill and recovery included


@dataclass(frozen=True, slots=True)
class MigrationOptions:
    model: str
    cache_dir: str
    kills: int
    num_streams: int
    max_tokens: int
    worker_args: tuple[str, ...]  # dtype, threads, KV memory: what every worker gets besides
    kv_store: Path | None  # G3 on this fresh store, or off


@dataclass(slots=True)
class Stream:
    """One stream's content deltas: (arrival time, ...) in order, and its request id."""

    request_id: str = ""
    times: list[float] = field(default_factory=list)
    got_token: asyncio.Event = field(default_factory=asyncio.Event)

    def on_event(self, event: dict[str, Any], now: float) -> None:
        self.request_id = self.request_id or str(event.get("id", ""))
        if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
            self.times.append(now)
            self.got_token.set()

    def gaps_before(self, t: float) -> list[float]:
        before = [x for x in self.times if x < t]
        return [b - a for a, b in itertools.pairwise(before)]

    def first_after(self, t: float) -> float | None:
        return next((x - t for x in self.times if x >= t), None)


@dataclass(slots=True)
class MigrationResult:
    next_token_s: list[float] = field(default_factory=list)  # per moved stream, kill -> next token
    itl_before_s: list[float] = field(default_factory=list)  # the moved streams' gaps before it
    rounds: list[str] = field(default_factory=list)  # one line per kill
    errors: list[str] = field(default_factory=list)


async def _wait_tokens(streams: list[Stream], tasks: list[asyncio.Task[Any]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(len(s.times) < MIN_TOKENS_BEFORE_KILL for s in streams):
        if any(t.done() for t in tasks):
            raise RuntimeError("a stream ended before the kill")
        if time.monotonic() > deadline:
            raise TimeoutError(f"streams without {MIN_TOKENS_BEFORE_KILL} tokens after {timeout_s:.0f} s")
        await asyncio.sleep(0.02)


async def _kill_when_quiet(fleet: ProcessFleet, victim: str, moved: list[Stream]) -> float:
    """SIGKILL ``victim`` just after a token of its streams (and its step's others) came; the time."""
    gaps = [g for s in moved for g in s.gaps_before(time.perf_counter())]
    for s in moved:
        s.got_token.clear()
    waits = [asyncio.ensure_future(s.got_token.wait()) for s in moved]
    _, pending = await asyncio.wait(waits, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    for w in pending:
        w.cancel()
    await asyncio.sleep(statistics.median(gaps) / 4 if gaps else 0.01)
    killed = time.perf_counter()
    fleet.kill_worker(victim)
    return killed


async def kill_round(
    fleet: ProcessFleet, http: httpx.AsyncClient, opts: MigrationOptions, result: MigrationResult
) -> None:
    tap = PlanTap()
    await tap.open(fleet.nats.url)
    streams = [Stream() for _ in range(opts.num_streams)]
    start = time.perf_counter()
    tasks = [
        asyncio.create_task(stream_chat(http, body, start, on_event=s.on_event))
        for s, body in zip(streams, _bodies(opts), strict=True)
    ]
    try:
        await _wait_tokens(streams, tasks, ROUND_TIMEOUT_S)
        await tap.close()
        loads = await worker_loads(fleet.nats.url, 1.0)
        victim = max(fleet.workers, key=lambda w: loads[w].num_running_seqs if w in loads else 0)
        if victim not in loads or loads[victim].num_running_seqs == 0:
            raise RuntimeError(f"no worker reports running sequences: {sorted(loads)}")
        moved = [s for s in streams if tap.worker_of.get(s.request_id) == victim]
        if not moved:
            raise RuntimeError(f"{victim} runs sequences, but none of this round's streams")
        killed = await _kill_when_quiet(fleet, victim, moved)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), ROUND_TIMEOUT_S)
    finally:
        await tap.close()
        for task in tasks:
            task.cancel()
    for outcome in outcomes:
        if outcome.error is not None or outcome.num_tokens != opts.max_tokens:
            result.errors.append(f"kill of {victim}: {outcome.error or f'{outcome.num_tokens} tokens'}")
    nexts = [s.first_after(killed) for s in moved]
    result.next_token_s += [n for n in nexts if n is not None]
    result.itl_before_s += [g for s in moved for g in s.gaps_before(killed)]
    shown = ", ".join("none" if n is None else f"{n:.2f} s" for n in nexts)
    result.rounds.append(
        f"kill -9 of {victim} ({len(moved)} of {len(streams)} streams on it): next token {shown}"
    )


def _bodies(opts: MigrationOptions) -> list[dict[str, Any]]:
    return [
        {
            "model": opts.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": opts.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for prompt in bench_prompts(opts.num_streams)
    ]


async def run_migration(opts: MigrationOptions, log: Path, progress: Any) -> MigrationResult:
    result = MigrationResult()
    with EmbeddedNatsServer() as nats:
        quiet = ["--log-level", "warning"]
        model = ["--model", opts.model, "--cache-dir", opts.cache_dir]
        store = ["--kv-store-path", str(opts.kv_store) if opts.kv_store else "none"]
        fleet = ProcessFleet(
            nats,
            log,
            worker_args=[*model, *opts.worker_args, *store, *quiet],
            scheduler_args=quiet,
            gateway_args=[*model, *quiet],
            kvcache_args=[*store, "--cache-dir", opts.cache_dir, *quiet] if opts.kv_store else None,
        )
        try:
            await _run_rounds(fleet, opts, result, progress)
        except (ChildExited, TimeoutError, RuntimeError) as exc:
            result.errors.append(f"{type(exc).__name__}: {exc}\n{log_tail(log)}")
        finally:
            fleet.stop()
    return result


async def _run_rounds(
    fleet: ProcessFleet, opts: MigrationOptions, result: MigrationResult, progress: Any
) -> None:
    fleet.start()
    for worker_id in ("fleet-worker-0", "fleet-worker-1"):
        fleet.add_worker(worker_id)
    wait_healthy(f"{fleet.base_url.removesuffix('/v1')}/health", fleet.processes(), READY_TIMEOUT_S, 0.2)
    for worker_id in list(fleet.workers):
        await wait_driven(fleet.nats.url, worker_id, READY_TIMEOUT_S)
    limits = httpx.Limits(max_connections=opts.num_streams + 4)
    async with httpx.AsyncClient(base_url=fleet.base_url, timeout=ROUND_TIMEOUT_S, limits=limits) as http:
        for kill in range(opts.kills):
            await kill_round(fleet, http, opts, result)
            progress(result.rounds[-1])
            if kill == opts.kills - 1:
                return  # no next round to serve
            replacement = f"fleet-worker-{kill + 2}"
            fleet.add_worker(replacement)
            await wait_driven(fleet.nats.url, replacement, READY_TIMEOUT_S)


def report_migration(opts: MigrationOptions, result: MigrationResult, summary: list[list[str]]) -> None:
    for line in result.rounds:
        print(f"  {line}")
    p50 = statistics.median(result.next_token_s) if result.next_token_s else None
    worst = max(result.next_token_s) if result.next_token_s else None
    itl = statistics.median(result.itl_before_s) if result.itl_before_s else None
    rows = [[str(len(result.rounds)), str(len(result.next_token_s)), ms(p50), ms(worst), ms(itl)]]
    print_table(
        f"migration: 2 workers, {opts.num_streams} streams x {opts.max_tokens} tokens per round, "
        f"G3 {'on' if opts.kv_store is not None else 'off'}",
        ["kills", "moved streams", "kill->next token p50 ms", "max ms", "ITL before (baseline) ms"],
        rows,
    )
    value = ratio(p50, itl)
    print(f"ratio migration kill->next token p50 / ITL before: {fmt_ratio(value)} (reported)")
    summary.append(["kill->next token p50 / ITL before", "-", fmt_ratio(value), "-"])
