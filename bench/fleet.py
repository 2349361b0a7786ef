"""Fleet benchmarks: scheduler replicas driving several workers, each figure beside a baseline
measured in the same run, and the ratio.

    python bench/fleet.py                     # every part, full size
    python bench/fleet.py --part routing --g3 # cache-aware routing with G3 on
    python bench/fleet.py --quick             # tiny sizes: a smoke run (CI)

Part routing: an agent multi-turn workload, --sessions sessions x --turns turns run concurrently,
each turn resending the whole conversation so far (its own system prompt of tool descriptions, the
previous tool results and answers) plus a new tool result (a file read: fleet_workload.py), greedy,
exactly --reply-tokens per answer; between an answer and the next turn the agent's tool runs for
a seeded random time (mean --tool-latency-s; without it, sessions in lock-step whose count is a
multiple of the workers' would meet their own worker again under round robin, an accident of
timing). It runs against a fresh `deepinfer serve --num-workers W --num-schedulers S` once with
`--routing round_robin` (the baseline: any replica, then its workers in turn) and once with
`--routing kv` (the gateway's router picks replica and worker); G3 off unless --g3 (then a fresh
store each). Each worker's G1 is sized to the workload (--kv-cache-gb 0): CACHE_SHARE x its fair
share of the sessions' longest contexts, and G2 is off (--host-cache-gb -1): every conversation
fits in the fleet's cache only if each stays on one worker, the regime routing is for (where any
worker holds every conversation, a random pick hits as well and the ratio says nothing). Per stack:
- hit rate: cached prompt tokens / prompt tokens summed over every request, from each response's
  usage (G1+G2, and G3 with --g3); beside it the per-tier rates from the gateway's /metrics
  (``deepinfer_kv_hit_tokens`` / ``deepinfer_kv_query_tokens`` of kind=scheduler, the change
  over the workload)
- TTFT p50 and p99 over every request: from sending it to its first content delta
- prompt tokens computed per worker: neither the scheduler's nor the worker's /metrics count
  them per worker, so they are read off the plans the scheduler sends each worker
  (fleet_stack.PlanTap: the tokens of each new sequence minus those whose KV it had or loaded);
  max/min over the workers is the spread (1.0: even)
Targets: kv / round_robin G1+G2 hit rate (from /metrics) >= 3x and TTFT p50 <= 0.4x; kv's own spread <= 1.3.

Part migration (fleet_migration.py): 2 workers, --kills rounds of kill -9 of the worker holding
streams: p50 and max kill-to-next-token of the moved streams, against their ITL before the kill.

Part pd (fleet_pd.py): decode ITL p99 of --pd-streams streams while --pd-long prompts of
--pd-long-tokens arrive, 1 prefill + 1 decode worker against 2 colocated ones, each worker pinned
to a core of its own. Target pd / colocated <= 0.5x.

Each process runs --threads torch threads, all sharing this machine's cores (no pinning, but for
the pd part's two workers): compare a figure only with its baseline in the same run. Exits 1 if a
stack failed or a stream erred.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from fleet_migration import MigrationOptions, report_migration, run_migration
from fleet_pd import PDOptions, report_pd, run_pd
from fleet_report import ms, percentile, ratio, target_row
from fleet_stack import PlanTap, worker_loads
from fleet_workload import CACHE_SHARE, kv_bytes_per_token, kv_cache_gb, system_prompt, tool_result
from prometheus_client.parser import text_string_to_metric_families
from prompts import bench_prompts
from random_model import EMBEDDED
from throughput import fmt_ratio, load_average, print_table, running_serve, stream_chat, stream_one

from libs.bus.nats_server import EmbeddedNatsServer
from libs.runtime.settings import resolve_cache_dir

PARTS = ("routing", "migration", "pd")
ROUTINGS = ("round_robin", "kv")  # the baseline first
TARGET_HIT_RATE = 3.0  # kv / round_robin, at least
TARGET_TTFT_P50 = 0.4  # kv / round_robin, at most
TARGET_SPREAD = 1.3  # kv's max/min of prompt tokens computed per worker, at most
STATS_INTERVAL_S = 0.5  # the schedulers' KV stats period: /metrics is this fresh
READY_LISTEN_S = 30.0  # longest wait for every worker's load report


@dataclass(frozen=True, slots=True)
class Options:
    parts: frozenset[str]
    num_workers: int
    num_sessions: int
    num_turns: int
    reply_tokens: int
    kills: int
    num_streams: int
    stream_tokens: int
    g3: bool
    dtype: str
    threads: int
    kv_cache_gb: float
    host_cache_gb: float
    model: str
    cache_dir: str
    num_schedulers: int = 1
    pd: PDOptions | None = None  # the pd part's own
    tool_latency_s: float = 3.0  # mean wait between an answer and the next turn (uniform, seeded)


@dataclass(frozen=True, slots=True)
class Turn:
    ttft_s: float | None  # None: the answer had no content
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass(slots=True)
class RoutingResult:
    routing: str
    turns: list[Turn] = field(default_factory=list)
    computed: dict[str, int] = field(default_factory=dict)  # worker id -> prompt tokens computed
    context_tokens: dict[int, int] = field(default_factory=dict)  # session -> its last prompt + answer
    tier_rates: dict[str, float] = field(default_factory=dict)  # from /metrics, over the workload
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        prompt = sum(t.num_prompt_tokens for t in self.turns)
        return sum(t.num_cached_tokens for t in self.turns) / prompt if prompt else 0.0

    @property
    def local_hit_rate(self) -> float | None:
        """G1+G2 hits / prompt tokens, from /metrics: what routing can win (G3 serves every worker)."""
        return self.tier_rates.get("G1", 0.0) + self.tier_rates.get("G2", 0.0) if self.tier_rates else None

    def ttft(self, q: float) -> float | None:
        return percentile([t.ttft_s for t in self.turns if t.ttft_s is not None], q)

    @property
    def spread(self) -> float | None:
        """Most prompt tokens a worker computed over the fewest (inf: one computed none)."""
        if not self.computed:
            return None
        low, high = min(self.computed.values()), max(self.computed.values())
        return high / low if low else math.inf


# --- part routing ------------------------------------------------------------------------------


@dataclass(slots=True)
class Reply:
    """An answer's content, from its stream's deltas."""

    parts: list[str] = field(default_factory=list)

    def on_event(self, event: dict[str, Any], now: float) -> None:
        self.parts.extend((c.get("delta") or {}).get("content") or "" for c in event.get("choices") or ())


async def run_session(http: httpx.AsyncClient, opts: Options, session: int, result: RoutingResult) -> None:
    messages = [{"role": "system", "content": system_prompt(session)}]
    tool_latency = random.Random(session)  # the same waits for both stacks
    for turn in range(opts.num_turns):
        if turn:  # the agent runs the tool its answer named
            await asyncio.sleep(tool_latency.uniform(0, 2 * opts.tool_latency_s))
        messages.append({"role": "user", "content": tool_result(session, turn)})
        body = {
            "model": opts.model,
            "messages": messages,
            "max_tokens": opts.reply_tokens,
            "temperature": 0,
            "ignore_eos": True,  # every answer as long as G1's sizing assumed
        }
        reply = Reply()
        outcome = await stream_chat(http, body, time.perf_counter(), reply.on_event)
        if outcome.error is not None or outcome.usage is None:
            result.errors.append(f"{result.routing}, session {session} turn {turn}: {outcome.error}")
            return
        usage = outcome.usage
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        result.turns.append(Turn(outcome.ttft_s, int(usage["prompt_tokens"]), cached))
        result.context_tokens[session] = int(usage["prompt_tokens"]) + int(usage["completion_tokens"])
        messages.append({"role": "assistant", "content": "".join(reply.parts)})


async def kv_counters(http: httpx.AsyncClient, root_url: str) -> dict[tuple[str, str], float]:
    """(name, label) -> the schedulers' KV counters summed, as /metrics shows them once fresh."""
    await asyncio.sleep(3 * STATS_INTERVAL_S)
    text = (await http.get(f"{root_url}/metrics")).text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("deepinfer_kv_") and s.labels.get("kind") == "scheduler":
                key = (s.name.removeprefix("deepinfer_kv_"), s.labels.get("label", ""))
                out[key] = out.get(key, 0.0) + s.value
    return out


def tier_rates(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict[str, float]:
    def delta(key: tuple[str, str]) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    queried = delta(("query_tokens", "all"))
    tiers = sorted(label for name, label in after if name == "hit_tokens")
    return {tier: delta(("hit_tokens", tier)) / queried for tier in tiers} if queried > 0 else {}


def workload_kv_cache_gb(opts: Options) -> float:
    """Each worker's G1 for the routing part (see fleet_workload.kv_cache_gb)."""
    return kv_cache_gb(
        opts.model, opts.cache_dir, opts.dtype, opts.num_workers, opts.num_sessions, opts.num_turns,
        opts.reply_tokens,
    )  # fmt: skip


def serve_flags(opts: Options, routing: str, nats_url: str, store: Path | None) -> dict[str, str]:
    return {
        "--nats-url": nats_url,
        "--num-workers": str(opts.num_workers),
        "--num-schedulers": str(opts.num_schedulers),
        "--routing": routing,
        "--model": opts.model,
        "--dtype": opts.dtype,
        "--num-threads": str(opts.threads),
        "--kv-cache-gb": str(opts.kv_cache_gb),
        "--host-cache-gb": str(opts.host_cache_gb),
        "--kv-store-path": str(store) if store else "none",
        "--kv-stats-interval-s": str(STATS_INTERVAL_S),
        "--cache-dir": opts.cache_dir,
        "--log-level": "warning",
    }


def routing_sizes(opts: Options) -> Options:
    """The routing part's cache sizes: as given, else G1 sized to the workload and G2 off."""
    kv_cache_gb = opts.kv_cache_gb or workload_kv_cache_gb(opts)
    return replace(opts, kv_cache_gb=kv_cache_gb, host_cache_gb=max(opts.host_cache_gb, 0.0))


async def run_routing(opts: Options, routing: str, tmp: Path) -> RoutingResult:
    result = RoutingResult(routing)
    store = tmp / f"kv-store-{routing}" if opts.g3 else None
    with EmbeddedNatsServer() as nats:
        flags = serve_flags(opts, routing, nats.url, store)
        with running_serve(flags, tmp / f"serve-{routing}.log", f"the {routing} stack") as (url, _):
            limits = httpx.Limits(max_connections=opts.num_sessions + 8)
            async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
                root = url.removesuffix("/v1")
                # First-request costs out of the way on every worker (round robin reaches each).
                warm = bench_prompts(2 * opts.num_workers)
                await asyncio.gather(*(stream_one(http, opts.model, p, 2, time.perf_counter()) for p in warm))
                # Every worker, even one that is sent no sequence (a slow one may miss a short listen).
                workers = set(await worker_loads(nats.url, READY_LISTEN_S, opts.num_workers))
                before = await kv_counters(http, root)
                tap = PlanTap()
                await tap.open(nats.url)
                started = time.perf_counter()
                try:
                    sessions = (run_session(http, opts, s, result) for s in range(opts.num_sessions))
                    await asyncio.gather(*sessions)
                finally:
                    result.seconds = time.perf_counter() - started
                    await tap.close()
                workers |= set(tap.num_computed_tokens)
                result.computed = {w: tap.num_computed_tokens[w] for w in sorted(workers)}
                result.tier_rates = tier_rates(before, await kv_counters(http, root))
    return result


# --- report ------------------------------------------------------------------------------------


def g1_share(opts: Options, results: dict[str, RoutingResult]) -> float:
    """The fleet's G1 over the tokens of every session's last prompt and answer (the largest of the
    stacks': their answers are alike, greedy and of one length)."""
    num_tokens = max((sum(r.context_tokens.values()) for r in results.values()), default=0)
    g1_bytes = opts.num_workers * opts.kv_cache_gb * 2**30
    return g1_bytes / (num_tokens * kv_bytes_per_token(opts.model, opts.dtype)) if num_tokens else 0.0


def report_routing(opts: Options, results: dict[str, RoutingResult], summary: list[list[str]]) -> None:
    rows = []
    for r in results.values():
        tiers = " ".join(f"{t} {v:.1%}" for t, v in r.tier_rates.items()) or "n/a"
        computed = " ".join(str(r.computed[w]) for w in sorted(r.computed))
        max_over_min = "n/a" if r.spread is None else f"{r.spread:.2f}"
        rows.append(
            [r.routing, str(len(r.turns)), f"{r.hit_rate:.1%}", tiers, ms(r.ttft(0.5)), ms(r.ttft(0.99)),
             computed, max_over_min, f"{r.seconds:.0f}"]
        )  # fmt: skip
    g3 = "on (a fresh store per stack)" if opts.g3 else "off"
    workload = f"{opts.num_sessions} sessions x {opts.num_turns} turns"
    workload += f", G1 {opts.kv_cache_gb:.3g} GB and G2 {opts.host_cache_gb:.3g} GB per worker"
    workload += f" (the fleet's G1 holds {g1_share(opts, results):.2f}x the sessions' last contexts)"
    print_table(
        f"routing: {opts.num_workers} workers, {opts.num_schedulers} scheduler(s), {workload}, G3 {g3}",
        ["routing", "requests", "hit rate", "/metrics by tier", "TTFT p50 ms", "TTFT p99 ms",
         "computed prompt tokens per worker", "max/min", "wall s"],
        rows,
    )  # fmt: skip
    base, kv = results.get("round_robin"), results.get("kv")
    if base is None or kv is None:
        return
    hit = ratio(kv.local_hit_rate, base.local_hit_rate)
    ttft = ratio(kv.ttft(0.5), base.ttft(0.5))
    print(f"ratio kv/round_robin G1+G2 hit rate: {fmt_ratio(hit)} (target >= {TARGET_HIT_RATE}x)")
    print(f"ratio kv/round_robin TTFT p50: {fmt_ratio(ttft)} (target <= {TARGET_TTFT_P50}x)")
    spread = fmt_ratio(kv.spread)
    print(f"kv max/min prompt tokens computed per worker: {spread} (target <= {TARGET_SPREAD}x)")
    summary.append(target_row("kv/round_robin G1+G2 hit rate", hit, TARGET_HIT_RATE, at_least=True))
    summary.append(target_row("kv/round_robin TTFT p50", ttft, TARGET_TTFT_P50, at_least=False))
    summary.append(target_row("kv max/min computed per worker", kv.spread, TARGET_SPREAD, at_least=False))


# --- main --------------------------------------------------------------------------------------


def parse_args() -> Options:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes (2 workers, 2 schedulers, 2 x 2 turns, 2 kills)"
    )
    parser.add_argument("--workers", type=int, default=4, help="workers of the routing part")
    parser.add_argument("--schedulers", type=int, default=1, help="scheduler replicas of the routing part")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument(
        "--reply-tokens", type=int, default=16, help="tokens per answer (a short one: it names the next tool)"
    )
    parser.add_argument(
        "--tool-latency-s",
        type=float,
        default=3.0,
        help="mean seconds an agent's tool runs between turns (a file read, a build, a test run)",
    )
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--streams", type=int, default=3, help="streams per migration round")
    parser.add_argument("--stream-tokens", type=int, default=128, help="tokens per migration stream")
    parser.add_argument("--g3", action="store_true", help="G3 on, a fresh temporary store per stack")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    parser.add_argument(
        "--kv-cache-gb",
        type=float,
        default=0.0,
        help=f"each worker's KV pages (G1); 0: routing part {CACHE_SHARE}x its share of the sessions' "
        "contexts, other parts 1.0",
    )
    parser.add_argument(
        "--host-cache-gb",
        type=float,
        default=-1.0,
        help="each worker's host memory (G2); -1: routing part 0, others 1.0",
    )
    parser.add_argument("--cache-dir", default="", help="converted-weights cache (default: the stack's)")
    parser.add_argument("--pd-streams", type=int, default=16, help="pd part: streams decoding")
    parser.add_argument("--pd-stream-tokens", type=int, default=2048, help="pd part: most tokens per stream")
    parser.add_argument("--pd-long", type=int, default=4, help="pd part: long prompts arriving")
    parser.add_argument("--pd-long-tokens", type=int, default=4096, help="pd part: tokens per long prompt")
    parser.add_argument("--pd-long-every-s", type=float, default=4.0, help="pd part: between long prompts")
    args = parser.parse_args()
    parts = frozenset(p for p in args.part.split(",") if p)
    if parts - set(PARTS):
        parser.error(f"unknown parts {sorted(parts - set(PARTS))}; expected some of {PARTS}")
    opts = Options(
        parts, args.workers, args.sessions, args.turns, args.reply_tokens, args.kills, args.streams,
        args.stream_tokens, args.g3, args.dtype, args.threads, args.kv_cache_gb, args.host_cache_gb,
        EMBEDDED, resolve_cache_dir(args.cache_dir, os.environ), args.schedulers,
    )  # fmt: skip
    cache_dir = resolve_cache_dir(args.cache_dir, os.environ)
    pd = PDOptions(
        EMBEDDED, args.dtype, cache_dir, args.pd_streams, args.pd_stream_tokens, args.pd_long,
        args.pd_long_tokens, args.pd_long_every_s, kv_cache_gb=1.5,
    )  # fmt: skip
    opts = replace(opts, pd=pd, tool_latency_s=args.tool_latency_s)
    if args.quick:
        opts = replace(
            opts, num_workers=2, num_schedulers=2, num_sessions=2, num_turns=2, reply_tokens=8, kills=2,
            tool_latency_s=0.1, num_streams=2, stream_tokens=48, kv_cache_gb=0.25, host_cache_gb=0.25,
            pd=replace(pd, num_streams=4, stream_tokens=512, num_long=1, long_tokens=1200, kv_cache_gb=0.5),
        )  # fmt: skip
    return opts


def migration_options(opts: Options, tmp: Path) -> MigrationOptions:
    worker_args: tuple[str, ...] = ("--dtype", opts.dtype, "--num-threads", str(opts.threads))
    kv_cache_gb, host_cache_gb = (
        opts.kv_cache_gb or 1.0,
        1.0 if opts.host_cache_gb < 0 else opts.host_cache_gb,
    )
    worker_args += ("--kv-cache-gb", str(kv_cache_gb), "--host-cache-gb", str(host_cache_gb))
    return MigrationOptions(
        opts.model, opts.cache_dir, opts.kills, opts.num_streams, opts.stream_tokens, worker_args,
        tmp / "kv-store-migration" if opts.g3 else None,
    )  # fmt: skip


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


async def main_async(opts: Options, tmp: Path) -> list[str]:
    """Runs the parts and prints their tables; returns the problems seen."""
    summary: list[list[str]] = []
    problems: list[str] = []
    if "routing" in opts.parts:
        routing_opts = routing_sizes(opts)
        results: dict[str, RoutingResult] = {}
        for routing in ROUTINGS:
            progress(f"routing part: {routing} stack")
            try:
                results[routing] = await run_routing(routing_opts, routing, tmp)
            except RuntimeError as exc:
                problems.append(f"{routing} stack: {exc}")
                continue
            problems += results[routing].errors
        report_routing(routing_opts, results, summary)
    if "migration" in opts.parts:
        progress("migration part")
        migration_opts = migration_options(opts, tmp)
        migration = await run_migration(migration_opts, tmp / "migration.log", progress)
        problems += migration.errors
        report_migration(migration_opts, migration, summary)
    if "pd" in opts.parts and opts.pd is not None:
        pd = await run_pd(opts.pd, tmp, progress)
        problems += [e for r in pd.values() for e in r.errors]
        report_pd(opts.pd, pd, summary)
    print_table("summary", ["figure", "goal", "measured", "status"], summary)
    return problems


def main() -> None:
    opts = parse_args()
    pinning = "no pinning, but for the pd part's workers"
    print(f"load average at start: {load_average()}; every process shares these cores ({pinning})")
    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-fleet-") as tmp:
        problems = asyncio.run(main_async(opts, Path(tmp)))
    print(f"load average at end: {load_average()}")
    print(f"\nproblems ({len(problems)}):" if problems else "\nproblems: none")
    for text in problems:
        print(f"  - {text}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
