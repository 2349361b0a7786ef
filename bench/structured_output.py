"""Structured output end to end: what grammar masks cost a running stack, against the same stack
decoding the same prompts unconstrained, in the same run.

    python bench/structured_output.py                    # ~3 min on 2 idle cores
    python bench/structured_output.py --grammar-backend outlines --streams 8 --max-tokens 32

1. Throughput: --streams concurrent streaming chat requests, greedy, exactly --max-tokens new
   tokens each. Unconstrained rows ignore EOS; constrained rows follow a JSON Schema whose
   shortest valid output is longer than --max-tokens (an array of at least 1000 strings), so both
   generate the same number of tokens; the unconstrained requests carry the schema text the chat
   format adds to a constrained prompt, so both decode the same prompt tokens. Prefix caching is
   off: every round computes its prompts. Rounds alternate (free, constrained, free, ...) and the best
   round of each counts. Target: constrained >= 0.97x.
2. TTFT, one request at a time, same prompt length: no constraint (the schema's text in the
   prompt, as the client's system turn); a schema seen before (both compile caches hit); a schema
   never seen (a fresh property name each time: gateway check + worker compile).

3. The same comparison in this process (--engine-rounds, 0 = skip): the scheduler core and the
   worker's ModelRunner (LocalEngine), no bus, no HTTP, the same prompt token ids in both modes,
   rounds interleaved; the median and the best ratio. It isolates the grammar's cost from the
   stack's run-to-run spread (+-10% on 2 cores).

Schema compile times and mask fill per backend, in process: bench/grammar.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from prompts import bench_prompts
from throughput import running_serve, stream_chat

from libs.runtime.settings import resolve_cache_dir

TARGET_RATIO = 0.97
MODEL = "SmolLM2-135M-Instruct"
LONG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1000}
    },
    "required": ["items"],
    "additionalProperties": False,
}


def json_schema_format(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def same_prompt(prompt: str, schema: dict[str, Any]) -> list[dict[str, str]]:
    """Messages that render to the very prompt tokens of ``prompt`` with ``schema`` as its response
    format: the system turn the chat format writes for a json_schema, written by the client."""
    section = "Reply with a single JSON value that follows this JSON schema:\n" + json.dumps(schema)
    return [{"role": "system", "content": section}, {"role": "user", "content": prompt}]


def request_body(prompt: str, max_tokens: int, constrained: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": max_tokens}
    if constrained:
        body["messages"] = [{"role": "user", "content": prompt}]
        body["response_format"] = json_schema_format(LONG_SCHEMA)
    else:
        body["messages"] = same_prompt(prompt, LONG_SCHEMA)
        body["ignore_eos"] = True
    return body


async def throughput(
    http: httpx.AsyncClient, prompts: list[str], max_tokens: int, rounds: int
) -> dict[bool, float]:
    """Best tokens/s per mode (constrained or not) over alternating rounds."""
    best = {False: 0.0, True: 0.0}
    for constrained in (False, True):  # warm-up: prefix of every code path, compiles the schema
        await asyncio.gather(*(stream_chat(http, request_body(p, 2, constrained), 0.0) for p in prompts))
    for i in range(2 * rounds):
        constrained = i % 2 == 1
        start = time.perf_counter()
        outcomes = await asyncio.gather(
            *(stream_chat(http, request_body(p, max_tokens, constrained), start) for p in prompts)
        )
        seconds = time.perf_counter() - start
        for o in outcomes:
            if o.error or o.num_tokens != max_tokens:
                raise RuntimeError(f"constrained={constrained}: {o.error or o.num_tokens} tokens")
        rate = sum(o.num_tokens for o in outcomes) / seconds
        label = "constrained" if constrained else "free"
        print(f"  round {i // 2 + 1} {label}: {rate:.1f} tok/s", file=sys.stderr, flush=True)
        best[constrained] = max(best[constrained], rate)
    return best


def fresh_schema() -> dict[str, Any]:
    name = "f" + uuid.uuid4().hex[:10]  # a property name never seen: nothing cached anywhere
    return {
        "type": "object",
        "properties": {name: {"type": "string", "maxLength": 20}, "count": {"type": "integer"}},
        "required": [name, "count"],
        "additionalProperties": False,
    }


async def ttfts(http: httpx.AsyncClient, prompt: str, num_requests: int) -> dict[str, float]:
    """Median time to first content token per case, one request at a time, cases interleaved.
    The unconstrained request carries the known schema's text, so all three prefill alike."""
    seen = fresh_schema()
    cases: dict[str, list[float]] = {"no constraint": [], "cached schema": [], "new schema": []}
    messages = [{"role": "user", "content": prompt}]
    base = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 4}
    await stream_chat(http, {**base, "response_format": json_schema_format(seen)}, 0.0)  # caches it
    for _ in range(num_requests):
        bodies = {
            "no constraint": {**base, "messages": same_prompt(prompt, seen)},
            "cached schema": {**base, "response_format": json_schema_format(seen)},
            "new schema": {**base, "response_format": json_schema_format(fresh_schema())},
        }
        for case, body in bodies.items():
            start = time.perf_counter()
            outcome = await stream_chat(http, body, start)
            if outcome.error or outcome.ttft_s is None:
                raise RuntimeError(f"{case}: {outcome.error or 'no content'}")
            cases[case].append(outcome.ttft_s)
    return {case: statistics.median(values) for case, values in cases.items()}


def stack_flags(args: argparse.Namespace) -> dict[str, str]:
    return {
        "--dtype": args.dtype,
        "--num-threads": str(args.threads),
        "--max-num-seqs": str(max(args.streams, 1)),
        "--grammar-backend": args.grammar_backend,
        # Every round computes its prompts, and a new schema's prompt is not cheaper or dearer
        # to prefill than a known one's: the cache would blur both comparisons.
        "--enable-prefix-caching": "false",
        "--cache-dir": resolve_cache_dir(args.cache_dir, os.environ),
        "--log-level": "warning",
    }


async def run(args: argparse.Namespace, base_url: str) -> None:
    limits = httpx.Limits(max_connections=args.streams + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        prompts = bench_prompts(args.streams)
        best = await throughput(http, prompts, args.max_tokens, args.rounds)
        times = await ttfts(http, prompts[0], args.ttft_requests)
    ratio = best[True] / best[False]
    setup = f"{args.dtype}, {args.streams} streams x {args.max_tokens} tokens"
    print(f"\nbackend {args.grammar_backend}, {setup}")
    print(f"{'':28}{'tok/s':>10}")
    print(f"{'unconstrained (baseline)':28}{best[False]:>10.1f}")
    print(f"{'json_schema constrained':28}{best[True]:>10.1f}")
    verdict = "met" if ratio >= TARGET_RATIO else "MISSED"
    print(f"ratio constrained / unconstrained: {ratio:.3f}x (target >= {TARGET_RATIO}: {verdict})")
    print(f"\nTTFT, one request at a time, median of {args.ttft_requests}:")
    for case, seconds in times.items():
        print(f"  {case:16} {seconds * 1e3:8.1f} ms  ({seconds / times['no constraint']:.2f}x)")


def engine_ratio(args: argparse.Namespace) -> None:
    """Constrained vs unconstrained tokens/s through LocalEngine, rounds interleaved."""
    import torch  # the stack parts need no torch in this process

    from deepinfer.local_engine import LocalEngine
    from libs.protocol.messages import SamplingParams, StructuredOutput, StructuredOutputKind
    from services.scheduler.worker_scheduler import Limits
    from services.worker.config import Config
    from services.worker.main import build_runner

    torch.set_num_threads(args.threads)
    cache_dir = resolve_cache_dir(args.cache_dir, os.environ)
    runner, max_model_len, _ = build_runner(Config(dtype=args.dtype, kv_cache_gb=1.0), cache_dir)
    runner.grammars.warm(args.grammar_backend)
    constraint = StructuredOutput(
        StructuredOutputKind.JSON_SCHEMA, json.dumps(LONG_SCHEMA), args.grammar_backend
    )
    prompts = [[1000 + 37 * i + j for j in range(60)] for i in range(args.streams)]
    limits = Limits(runner.kv_cache.num_blocks, 16, args.streams, max_model_len, 2048, 256, 0.0, False)

    def tokens_per_s(constrained: bool, tag: str) -> float:
        engine = LocalEngine(runner, limits, eos_token_id=2, overlap=True)
        params = SamplingParams(
            temperature=0,
            max_tokens=args.max_tokens,
            ignore_eos=not constrained,
            structured_output=constraint if constrained else None,
        )
        start = time.perf_counter()
        outputs = engine.run((0, f"{tag}-{i}", prompt, params) for i, prompt in enumerate(prompts))
        seconds = time.perf_counter() - start
        assert all(len(tokens) == args.max_tokens for tokens in outputs.values())
        return float(len(prompts) * args.max_tokens / seconds)

    tokens_per_s(True, "warm-c"), tokens_per_s(False, "warm-f")
    rates: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.engine_rounds):
        for constrained in (False, True):
            rates[constrained].append(tokens_per_s(constrained, f"{constrained}-{r}"))
    median = statistics.median(rates[True]) / statistics.median(rates[False])
    best = max(rates[True]) / max(rates[False])
    print(f"\nin process (LocalEngine), {args.engine_rounds} interleaved rounds:")
    print(f"  unconstrained tok/s {[round(x, 1) for x in rates[False]]}")
    print(f"  constrained   tok/s {[round(x, 1) for x in rates[True]]}")
    print(f"  ratio of medians {median:.3f}x, of bests {best:.3f}x (target >= {TARGET_RATIO})")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per mode, best kept")
    parser.add_argument("--ttft-requests", type=int, default=10)
    parser.add_argument("--grammar-backend", default="xgrammar", choices=["xgrammar", "outlines"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", default="")
    parser.add_argument("--engine-rounds", type=int, default=6, help="in-process rounds per mode (0: skip)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        try:
            with running_serve(stack_flags(args), log) as (base_url, _):
                asyncio.run(run(args, base_url))
        except Exception:
            print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise
    if args.engine_rounds:
        engine_ratio(args)


if __name__ == "__main__":
    main()
