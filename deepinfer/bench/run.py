"""A ``deepinfer bench`` run from its parsed flags: one warm-up request, one run per load level with
a progress bar, then the reports and a summary on stdout; exit 1 if any request failed."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from tqdm import tqdm

from deepinfer.bench import FULL, QUICK
from deepinfer.bench.client import first_model, open_client, stream_chat
from deepinfer.bench.economics import CACHE_HIT_DISCOUNT, DEVICE_TIME_NOTE, Prices, economics
from deepinfer.bench.loadgen import Load, RequestOptions, run_load
from deepinfer.bench.metrics import summarize
from deepinfer.bench.report import write_reports
from deepinfer.bench.workloads import Lengths, Turn, build

Number = TypeVar("Number", int, float)


@dataclass(frozen=True, slots=True)
class Plan:
    loads: tuple[Load, ...]
    num_prompts: int
    inputs: Lengths
    outputs: Lengths
    prices: Prices


def numbers(text: str, kind: type[Number]) -> list[Number]:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated {kind.__name__}s, not {text!r}") from None


def plan(args: argparse.Namespace) -> Plan:
    """The flags with --quick's or the full defaults filled in where none was given."""
    defaults = QUICK if args.quick else FULL
    if args.request_rate:
        loads = tuple(Load(request_rate=r) for r in numbers(args.request_rate, float))
    elif args.concurrency or args.quick:
        loads = tuple(Load(concurrency=n) for n in numbers(args.concurrency or QUICK["concurrency"], int))
    else:
        raise ValueError("--concurrency or --request-rate is required (or --quick)")
    num_prompts = int(defaults["num_prompts"]) if args.num_prompts is None else args.num_prompts
    if num_prompts < 1 or args.num_devices < 1 or not loads:
        raise ValueError("--num-prompts, --num-devices and the load levels must be at least 1")
    cached = args.price_cached_input_per_m
    prices = Prices(
        input_per_m=args.price_input_per_m,
        cached_input_per_m=args.price_input_per_m / CACHE_HIT_DISCOUNT if cached is None else cached,
        output_per_m=args.price_output_per_m,
        rental_per_device_hour=args.rental_price_per_hour,
        num_devices=args.num_devices,
    )
    inputs = Lengths.parse(args.input_len or defaults["input_len"])
    return Plan(loads, num_prompts, inputs, Lengths.parse(args.output_len or defaults["output_len"]), prices)


async def bench(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    async with open_client(args.base_url, args.api_key, args.timeout_s) as http:
        model = args.model or await first_model_or_exit(http)
        opts = RequestOptions(model, args.temperature, args.ignore_eos)
        hello = opts.body([{"role": "user", "content": "Hello"}], Turn("", 2))
        warm = await stream_chat(http, hello, 0.0, require_usage=False)
        if warm.error is not None:
            sys.exit(f"deepinfer bench: the warm-up request to {args.base_url} failed: {warm.error}")
        # Each run its own prompts (seed, seed + 1, ...): none served from what an earlier run cached.
        runs = [
            await one_run(http, args, plan, opts, load, args.seed + i) for i, load in enumerate(plan.loads)
        ]
    return {
        "config": config(args, plan, model),
        "prices": plan.prices.as_dict(),
        "device_time": DEVICE_TIME_NOTE,
        "runs": runs,
    }


async def one_run(
    http: httpx.AsyncClient, args: argparse.Namespace, plan: Plan, opts: RequestOptions, load: Load, seed: int
) -> dict[str, Any]:
    sessions = build(
        args.workload, plan.num_prompts, plan.inputs, plan.outputs, seed, args.turns, args.prediction
    )
    with tqdm(total=plan.num_prompts, desc=load.label, unit="req", file=sys.stderr) as bar:
        outcomes, duration = await run_load(http, sessions, load, opts, bar.update, seed)
    run: dict[str, Any] = {
        "load": load.label,
        "max_concurrency": load.concurrency,
        "request_rate": load.request_rate,
    }
    run |= summarize(outcomes, duration)
    run["economics"] = economics(run, plan.prices)
    return run


async def first_model_or_exit(http: httpx.AsyncClient) -> str:
    try:
        return await first_model(http)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        sys.exit(f"deepinfer bench: no model named and none found at {http.base_url}models: {exc}")


def config(args: argparse.Namespace, plan: Plan, model: str) -> dict[str, Any]:
    rate = plan.loads[0].request_rate is not None
    return {
        "base_url": args.base_url,
        "model": model,
        "workload": args.workload,
        "num_prompts": plan.num_prompts,
        "input_len": str(plan.inputs),
        "output_len": str(plan.outputs),
        "turns": args.turns if args.workload == "agent" else None,
        "prediction": args.prediction if args.workload == "code-edit" else None,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "seed": args.seed,
        "load_kind": "request_rate" if rate else "max_concurrency",
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def summary_line(run: dict[str, Any]) -> str:
    e = run["economics"]
    per_hour = e["revenue_per_device_hour"]
    return (
        f"{run['load']:>16}  {run['completed']:>5} ok {run['failed']:>3} failed  {run['duration']:7.2f} s"
        f"  {run['output_throughput']:9.1f} out tok/s"
        f"  TTFT {run['median_ttft_ms']:7.1f} / {run['p99_ttft_ms']:7.1f} ms"
        f"  ITL {run['median_itl_ms']:6.1f} / {run['p99_itl_ms']:6.1f} ms"
        f"  ${0.0 if per_hour is None else per_hour:.4f} per device-hour"
    )


def run(args: argparse.Namespace) -> None:
    report = asyncio.run(bench(args, plan(args)))
    paths = write_reports(Path(args.out), report)
    print("load, requests, duration, output throughput, TTFT and ITL median / p99, revenue")
    for run_ in report["runs"]:
        print(summary_line(run_))
    print("reports: " + ", ".join(str(p) for p in paths))
    failed = sum(r["failed"] for r in report["runs"])
    if failed:
        errors = dict.fromkeys(e for r in report["runs"] for e in r["errors"] if e)
        print(f"{failed} request(s) failed: " + "; ".join(list(errors)[:3]), file=sys.stderr)
        sys.exit(1)
