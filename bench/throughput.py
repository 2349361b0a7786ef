"""Engine-core throughput: aggregate output tokens/s at several numbers of concurrent streams,
each against a named baseline measured in the same run, then a summary of the targets.

    python bench/throughput.py                       # every part: ~5 min on 2 idle cores
    python bench/throughput.py --parts d --concurrency 1,8 --max-tokens 32   # one piece, small

Parts (--parts, comma-separated; default all):
  a    the full stack (`deepinfer serve`, streaming HTTP) vs transformers `generate` on the same
       GGUF weights in the same dtype (all prompts in one batch, left padding)
  b    vs llama.cpp on the same GGUF (bench/llamacpp_baseline.py; skipped with a message when
       llama-cpp-python is not installed): the stack at --streams-vs-llamacpp streams vs
       llama.cpp's best aggregate (target >= 1.5x), and the stack at one stream for every weight
       format the worker accepts vs llama.cpp at one (target >= 1x)
  d    overlap scheduling: the stack with --overlap true vs --overlap false
  det  the stack with --deterministic true (bf16, batch-invariant kernels) vs without it in the
       worker's default format, --dtype auto (target at 8 streams: >= 0.7x)
  bus  the stack vs the same scheduler core and ModelRunner in this process (LocalEngine, no bus,
       no HTTP), same model, dtype and limits (target: stack >= 0.95x)

Every engine decodes the same chat prompts greedily with EOS ignored, exactly --max-tokens new
tokens per sequence, with --threads threads. tokens/s = generated tokens over the wall time from
the first request to the last token, prefill included; every level is warmed up first with the
same prompts and two tokens. A stack is started once per (dtype, overlap) and serves all its
levels.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import io
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import llamacpp_baseline
import torch
from prompts import bench_prompts, chat_prompts

# the streaming client: the benches beside this one import it from here
from deepinfer.bench.client import StreamOutcome as StreamOutcome
from deepinfer.bench.client import stream_chat as stream_chat
from deepinfer.local_engine import LocalEngine
from deepinfer.serve import ChildExited, wait_healthy
from libs.bus.nats_server import free_port
from libs.modelfiles.registry import resolve_model_path
from libs.protocol.messages import SamplingParams
from libs.runtime.settings import resolve_cache_dir
from services.gateway.served_model import ServedModel
from services.scheduler.config import Config as SchedulerConfig
from services.scheduler.worker_scheduler import Limits
from services.worker.config import Config as WorkerConfig
from services.worker.main import build_runner

PARTS = ("a", "b", "d", "det", "bus")
WEIGHT_FORMATS = ("bfloat16", "float32", "int8", "int4")  # the worker's --dtype weight formats
TARGET_VS_LLAMACPP = 1.5
TARGET_BATCH1_VS_LLAMACPP = 1.0
TARGET_STACK_VS_LOCAL = 0.95
TARGET_DETERMINISTIC = 0.7  # at 8 streams
STACK_READY_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class Options:
    parts: frozenset[str]
    concurrency: tuple[int, ...]
    overlap_concurrency: tuple[int, ...]
    deterministic_concurrency: tuple[int, ...]
    streams_vs_llamacpp: int
    max_tokens: int
    dtype: str
    threads: int
    kv_cache_gb: float
    max_num_batched_tokens: int
    model: str
    cache_dir: str
    repeats: int  # timed runs per level; the best counts

    @property
    def max_num_seqs(self) -> int:
        """The most streams any requested part runs: the limit every engine is given."""
        levels = list(self.concurrency) if self.parts & {"a", "b", "bus"} else []
        if "b" in self.parts:
            levels.append(self.streams_vs_llamacpp)
        if "d" in self.parts:
            levels += self.overlap_concurrency
        if "det" in self.parts:
            levels += self.deterministic_concurrency
        return max(levels)


@dataclass(frozen=True, slots=True)
class Result:
    num_seqs: int
    num_tokens: int
    seconds: float
    errors: tuple[str, ...] = ()
    ttft_s: float | None = None  # median time to first content, streams only

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class StackSetup:
    dtype: str
    overlap: bool
    deterministic: bool = False

    @property
    def label(self) -> str:
        mode = " deterministic" if self.deterministic else ""
        return f"stack {self.dtype} overlap={'on' if self.overlap else 'off'}{mode}"


# Part det: the flag (which runs bf16) against what a user runs without it, the worker's default
# weight format (--dtype auto), whatever --dtype the other parts use.
DETERMINISTIC_SETUPS = (StackSetup("bfloat16", True, deterministic=True), StackSetup("auto", True))


@dataclass(slots=True)
class Report:
    """Everything measured, keyed by engine label then number of streams, plus problems seen."""

    results: dict[str, dict[int, Result]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def add(self, engine: str, result: Result) -> None:
        self.results.setdefault(engine, {})[result.num_seqs] = result
        ttft = f", ttft p50 {result.ttft_s:.2f} s" if result.ttft_s is not None else ""
        self.progress(f"{engine}, {result.num_seqs} streams: {result.tokens_per_s:.1f} tok/s{ttft}")
        for error in dict.fromkeys(result.errors):
            count = result.errors.count(error)
            self.problem(f"{engine}, {result.num_seqs} streams: {count}x {error}")

    def rate(self, engine: str, num_seqs: int) -> float | None:
        result = self.results.get(engine, {}).get(num_seqs)
        return result.tokens_per_s if result is not None and result.num_tokens else None

    def problem(self, text: str) -> None:
        self.problems.append(text)
        self.progress(f"PROBLEM: {text}")

    def progress(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:6.0f} s] {text}", file=sys.stderr, flush=True)


# --- the full stack over HTTP ------------------------------------------------------------------


async def stream_one(
    http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, start: float
) -> StreamOutcome:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    outcome = await stream_chat(http, body, start)
    if outcome.error is None and outcome.num_tokens != max_tokens:
        return replace(outcome, error=f"{outcome.num_tokens} completion tokens, expected {max_tokens}")
    return outcome


async def stream_level(
    base_url: str, model: str, prompts: list[str], max_tokens: int, repeats: int
) -> Result:
    """A warm-up round, then all prompts as concurrent streams `repeats` times; the best run."""
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        warm = await asyncio.gather(*(stream_one(http, model, p, 2, time.perf_counter()) for p in prompts))
        errors = [f"warm-up: {o.error}" for o in warm if o.error]
        results = []
        for _ in range(repeats):
            start = time.perf_counter()
            outcomes = await asyncio.gather(*(stream_one(http, model, p, max_tokens, start) for p in prompts))
            seconds = time.perf_counter() - start
            errors += [o.error for o in outcomes if o.error]
            ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
            num_tokens = sum(o.num_tokens for o in outcomes)
            ttft = statistics.median(ttfts) if ttfts else None
            results.append(Result(len(prompts), num_tokens, seconds, ttft_s=ttft))
    best = max(results, key=lambda r: r.tokens_per_s)
    return Result(best.num_seqs, best.num_tokens, best.seconds, tuple(errors), best.ttft_s)


def stack_flags(setup: StackSetup, opts: Options) -> dict[str, str]:
    return {
        "--model": opts.model,
        "--dtype": setup.dtype,
        "--overlap": "true" if setup.overlap else "false",
        "--deterministic": "true" if setup.deterministic else "false",
        "--num-threads": str(opts.threads),
        "--max-num-seqs": str(opts.max_num_seqs),
        "--kv-cache-gb": str(opts.kv_cache_gb),
        "--max-num-batched-tokens": str(opts.max_num_batched_tokens),
        "--cache-dir": opts.cache_dir,
        "--log-level": "warning",
    }


@contextlib.contextmanager
def running_serve(
    flags: dict[str, str], log: Path, label: str = "the stack"
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`deepinfer serve FLAGS` on a free port until /health answers; yields (base URL, process)."""
    port = free_port()
    argv = [sys.executable, "-m", "deepinfer", "serve", "--port", str(port)]
    argv += [x for kv in flags.items() for x in kv]
    # SIGINT: no drain wanted, serve stops everything within seconds
    with running_server(argv, port, log, label, signal.SIGINT) as proc:
        yield f"http://127.0.0.1:{port}/v1", proc


@contextlib.contextmanager
def running_server(
    argv: list[str], port: int, log: Path, label: str, stop: signal.Signals
) -> Iterator[subprocess.Popen[bytes]]:
    """The server ``argv`` (listening on ``port``, output to ``log``) until its /health answers;
    sent ``stop`` on exit, killed if it has not ended 30 s later."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        try:
            wait_healthy(f"http://127.0.0.1:{port}/health", [proc], STACK_READY_TIMEOUT_S, interval_s=0.2)
        except (ChildExited, TimeoutError) as exc:
            raise RuntimeError(f"{label} did not become ready ({exc}):\n{log_tail(log)}") from exc
        yield proc
    finally:
        proc.send_signal(stop)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def log_tail(log: Path, num_lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-num_lines:])


def log_problems(log: Path) -> list[str]:
    """Warnings, errors and tracebacks the stack logged (it runs at --log-level warning)."""
    lines = log.read_text(errors="replace").splitlines()
    marks = ("WARNING", "ERROR", "CRITICAL", "Traceback", "Error:", "Exception")
    return list(dict.fromkeys(line.strip() for line in lines if any(m in line for m in marks)))[:20]


def run_stack(
    setup: StackSetup, levels: list[int], opts: Options, served: ServedModel, report: Report
) -> None:
    report.progress(f"starting {setup.label} for {levels} streams")
    prompts = bench_prompts(max(levels))
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        try:
            with running_serve(stack_flags(setup, opts), log, setup.label) as (base_url, proc):
                for n in levels:
                    report.add(
                        setup.label,
                        asyncio.run(
                            stream_level(base_url, served.name, prompts[:n], opts.max_tokens, opts.repeats)
                        ),
                    )
                    if proc.poll() is not None:
                        raise RuntimeError(f"the stack exited (code {proc.returncode}) after {n} streams")
        except Exception as exc:
            report.problem(f"{setup.label}: {exc}")
        for line in log_problems(log):
            report.problem(f"{setup.label} logged: {line}")


# --- baselines in this process -----------------------------------------------------------------


def run_local(opts: Options, served: ServedModel, report: Report) -> None:
    """LocalEngine: the scheduler core and the worker's own ModelRunner, no bus, same limits."""
    worker = WorkerConfig(
        model=opts.model,
        dtype=opts.dtype,
        max_num_seqs=opts.max_num_seqs,
        kv_cache_gb=opts.kv_cache_gb,
        num_threads=opts.threads,
    )
    runner, max_model_len, _ = build_runner(worker, opts.cache_dir)
    limits = Limits(
        num_blocks=runner.kv_cache.num_blocks,
        block_size=runner.block_size,
        max_num_seqs=opts.max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        max_num_waiting=SchedulerConfig().max_num_waiting,
    )
    prompts = chat_prompts(served, max(opts.concurrency))

    def generate(batch: list[list[int]], max_tokens: int) -> Result:
        runner.reset()
        engine = LocalEngine(runner, limits, served.eos_token_id, overlap=True)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        engine.run([(0, f"r{i}", p, params) for i, p in enumerate(batch)])
        seconds = time.perf_counter() - start
        counts = [len(tokens) for tokens in engine.outputs.values()]
        errors = [f"{c} tokens, expected {max_tokens}" for c in counts if c != max_tokens]
        return Result(len(batch), sum(counts), seconds, tuple(errors))

    sweep("in-process", generate, prompts, opts, report)


def run_transformers(opts: Options, served: ServedModel, report: Report) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import accelerate  # noqa: F401  (transformers needs it to load a GGUF)
        import transformers
    except ImportError as exc:
        report.problem(f"transformers baseline skipped: {exc}")
        return
    hf: Any = transformers
    hf.logging.set_verbosity_error()
    hf.logging.disable_progress_bar()
    path = resolve_model_path(opts.model)
    with contextlib.redirect_stderr(io.StringIO()):  # its GGUF conversion progress bar
        model = hf.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=getattr(torch, opts.dtype)
        ).eval()
    pad = served.eos_token_id

    def generate(batch: list[list[int]], max_tokens: int) -> Result:
        width = max(len(p) for p in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):  # left padding
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=served.eos_token_id,
            )
        seconds = time.perf_counter() - start
        new = int(out.shape[1]) - width
        errors = () if new == max_tokens else (f"{new} new tokens, expected {max_tokens}",)
        return Result(len(batch), len(batch) * new, seconds, errors)

    sweep("transformers", generate, chat_prompts(served, max(opts.concurrency)), opts, report)


def sweep(
    engine: str,
    generate: Callable[[list[list[int]], int], Result],
    prompts: list[list[int]],
    opts: Options,
    report: Report,
) -> None:
    report.progress(f"running {engine} for {list(opts.concurrency)} streams")
    for n in opts.concurrency:
        try:
            generate(prompts[:n], 2)  # warm-up
            runs = [generate(prompts[:n], opts.max_tokens) for _ in range(opts.repeats)]
            report.add(engine, max(runs, key=lambda r: r.tokens_per_s))
        except Exception as exc:
            report.problem(f"{engine}, {n} streams: {type(exc).__name__}: {exc}")
            return


def run_llamacpp(opts: Options, served: ServedModel, report: Report) -> None:
    levels = sorted({*opts.concurrency, 1})
    report.progress(f"running llama.cpp for {levels} streams")
    prompts = chat_prompts(served, max(levels))
    try:
        runs, info = llamacpp_baseline.sweep(
            resolve_model_path(opts.model), prompts, levels, opts.max_tokens, opts.threads, opts.repeats
        )
    except Exception as exc:
        report.problem(f"llama.cpp: {type(exc).__name__}: {exc}")
        return
    report.notes.append(f"llama.cpp system info: {info}")
    for n, run in runs.items():
        report.add("llama.cpp", Result(n, run.num_tokens, run.seconds))


# --- plan and tables ---------------------------------------------------------------------------


def plan_stacks(opts: Options, with_llamacpp: bool) -> dict[StackSetup, list[int]]:
    main = StackSetup(opts.dtype, overlap=True)
    plan: dict[StackSetup, set[int]] = {main: set()}
    if opts.parts & {"a", "bus"}:
        plan[main] |= set(opts.concurrency)
    if "b" in opts.parts and with_llamacpp:
        plan[main] |= {1, opts.streams_vs_llamacpp}
        for fmt in WEIGHT_FORMATS:
            plan.setdefault(StackSetup(fmt, overlap=True), set()).add(1)
    if "d" in opts.parts:
        plan[main] |= set(opts.overlap_concurrency)
        plan[StackSetup(opts.dtype, overlap=False)] = set(opts.overlap_concurrency)
    if "det" in opts.parts:
        for setup in DETERMINISTIC_SETUPS:
            plan.setdefault(setup, set()).update(opts.deterministic_concurrency)
    return {setup: sorted(levels) for setup, levels in plan.items() if levels}


def fmt_rate(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "n/a"


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def fmt_ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "n/a"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    print(f"\n== {title} ==")
    for row in [header, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def vs_table(report: Report, title: str, ours: str, base: str, levels: tuple[int, ...]) -> None:
    rows = []
    for n in levels:
        a, b = report.rate(ours, n), report.rate(base, n)
        rows.append([str(n), fmt_rate(a), fmt_rate(b), fmt_ratio(ratio(a, b))])
    print_table(title, ["streams", f"{ours} tok/s", f"{base} tok/s", "ratio"], rows)


def target_row(name: str, value: float | None, goal: float | None) -> list[str]:
    """A summary row: the ratio measured against its goal (None: reported, no target)."""
    if goal is None:
        return [name, "-", fmt_ratio(value), "-"]
    verdict = "n/a" if value is None else ("met" if value >= goal else "missed")
    return [name, f">= {goal}x", fmt_ratio(value), verdict]


def report_part_b(report: Report, opts: Options, summary: list[list[str]]) -> None:
    llama = report.results.get("llama.cpp", {})
    at = opts.streams_vs_llamacpp
    if not llama:
        print("\n== (b) vs llama.cpp: skipped (see problems) ==")
        summary.append(target_row(f"(b) stack @{at} vs llama.cpp best", None, TARGET_VS_LLAMACPP))
        return
    rows = [[str(n), fmt_rate(r.tokens_per_s)] for n, r in sorted(llama.items())]
    print_table("(b) llama.cpp (same GGUF, low-level batched API)", ["streams", "llama.cpp tok/s"], rows)
    best_n = max(llama, key=lambda n: llama[n].tokens_per_s)
    best, batch1 = llama[best_n].tokens_per_s, report.rate("llama.cpp", 1)
    main = StackSetup(opts.dtype, overlap=True).label
    ours = report.rate(main, at)
    rows = [[f"{main} @{at}", fmt_rate(ours), f"best {best:.1f} @{best_n}", fmt_ratio(ratio(ours, best))]]
    summary.append(
        target_row(f"(b) stack @{at} vs llama.cpp best (@{best_n})", ratio(ours, best), TARGET_VS_LLAMACPP)
    )
    for fmt in WEIGHT_FORMATS:
        label = StackSetup(fmt, overlap=True).label
        one = report.rate(label, 1)
        rows.append(
            [f"{label} @1", fmt_rate(one), f"batch-1 {fmt_rate(batch1)}", fmt_ratio(ratio(one, batch1))]
        )
        summary.append(
            target_row(
                f"(b) batch-1 {fmt} vs llama.cpp batch-1", ratio(one, batch1), TARGET_BATCH1_VS_LLAMACPP
            )
        )
    print_table("(b) ours vs llama.cpp", ["ours", "tok/s", "llama.cpp tok/s", "ratio"], rows)


def print_report(report: Report, opts: Options) -> None:
    main, off = StackSetup(opts.dtype, True).label, StackSetup(opts.dtype, False).label
    deterministic, default = (setup.label for setup in DETERMINISTIC_SETUPS)
    summary: list[list[str]] = []
    print(
        f"\nmodel {opts.model}, dtype {opts.dtype}, {opts.max_tokens} tokens/stream, {opts.threads} threads, "
        f"max_num_seqs {opts.max_num_seqs}, max_num_batched_tokens {opts.max_num_batched_tokens}, "
        f"best of {opts.repeats}"
    )
    compared = {  # part -> (title, row name, engine, baseline engine, levels, target)
        "a": (
            f"(a) full stack vs transformers generate ({opts.dtype})",
            "stack vs transformers",
            main,
            "transformers",
            opts.concurrency,
            None,
        ),
        "d": (
            "(d) overlap scheduling on vs off",
            "overlap on vs off",
            main,
            off,
            opts.overlap_concurrency,
            None,
        ),
        "det": (
            "(det) --deterministic (bf16) vs the default weight format without it",
            "deterministic vs not",
            deterministic,
            default,
            opts.deterministic_concurrency,
            TARGET_DETERMINISTIC,
        ),
        "bus": (
            "bus overhead: full stack vs LocalEngine in-process",
            "stack vs in-process",
            main,
            "in-process",
            opts.concurrency,
            TARGET_STACK_VS_LOCAL,
        ),
    }
    for part in PARTS:
        if part not in opts.parts:
            continue
        if part == "b":
            report_part_b(report, opts, summary)
            continue
        title, name, ours, base, levels, goal = compared[part]
        vs_table(report, title, ours, base, levels)
        for n in levels:
            value = ratio(report.rate(ours, n), report.rate(base, n))
            at_target = goal if part != "det" or n == 8 else None
            summary.append(target_row(f"({part}) {name} @{n}", value, at_target))
    ttfts = [
        [engine, str(n), f"{r.ttft_s:.2f}"]
        for engine, by_n in report.results.items()
        for n, r in sorted(by_n.items())
        if r.ttft_s is not None
    ]
    if ttfts:
        print_table("time to first token (median over streams, s)", ["engine", "streams", "ttft"], ttfts)
    print_table("summary", ["target", "goal", "measured", "status"], summary)
    print()
    for note in report.notes:
        print(note)
    print(f"\nproblems ({len(report.problems)}):" if report.problems else "\nproblems: none")
    for text in report.problems:
        print(f"  - {text}")


# --- main --------------------------------------------------------------------------------------


def load_average() -> str:
    """1/5/15-minute load against the cores: other work on a shared machine skews every figure."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} / {five:.1f} / {fifteen:.1f} on {os.cpu_count()} cores"


def parse_args() -> Options:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )

    def levels(text: str) -> tuple[int, ...]:
        return tuple(sorted({int(x) for x in text.split(",") if x}))

    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--concurrency", type=levels, default=(1, 8, 32, 64), help="streams for a, b, bus")
    parser.add_argument("--overlap-concurrency", type=levels, default=(1, 8, 32), help="streams for d")
    parser.add_argument("--deterministic-concurrency", type=levels, default=(1, 8), help="streams for det")
    parser.add_argument("--streams-vs-llamacpp", type=int, default=32, help="stack streams compared in b")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per stream")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2, help="torch / llama.cpp threads everywhere")
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=SchedulerConfig().max_num_batched_tokens
    )
    parser.add_argument("--model", default="smollm2", help="'smollm2' (embedded) or a llama-family .gguf")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per level, best kept")
    parser.add_argument("--cache-dir", default="", help="converted-weights cache (default: the stack's)")
    args = parser.parse_args()
    parts = frozenset(p for p in args.parts.split(",") if p)
    if parts - set(PARTS):
        parser.error(f"unknown parts {sorted(parts - set(PARTS))}; expected some of {PARTS}")
    return Options(
        parts=parts,
        concurrency=args.concurrency,
        overlap_concurrency=args.overlap_concurrency,
        deterministic_concurrency=args.deterministic_concurrency,
        streams_vs_llamacpp=args.streams_vs_llamacpp,
        max_tokens=args.max_tokens,
        dtype=args.dtype,
        threads=args.threads,
        kv_cache_gb=args.kv_cache_gb,
        max_num_batched_tokens=args.max_num_batched_tokens,
        model=args.model,
        cache_dir=resolve_cache_dir(args.cache_dir, os.environ),
        repeats=args.repeats,
    )


def main() -> None:
    opts = parse_args()
    torch.set_num_threads(opts.threads)
    report = Report()
    report.notes.append(f"load average at start: {load_average()}")
    served = ServedModel.load(opts.model, opts.cache_dir, "", 0)
    no_llamacpp = llamacpp_baseline.available() if "b" in opts.parts else None
    if no_llamacpp is not None:
        report.problem(f"(b) skipped: {no_llamacpp}")
    for setup, levels in plan_stacks(opts, no_llamacpp is None).items():
        run_stack(setup, levels, opts, served, report)
    if "bus" in opts.parts:
        run_local(opts, served, report)
        gc.collect()
    if "a" in opts.parts:
        run_transformers(opts, served, report)
        gc.collect()
    if "b" in opts.parts and no_llamacpp is None:
        run_llamacpp(opts, served, report)
    report.notes.append(f"load average at end: {load_average()}")
    print_report(report, opts)
    report.progress("done")


if __name__ == "__main__":
    main()
