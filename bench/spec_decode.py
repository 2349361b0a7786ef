"""Speculative decoding on SmolLM2 through the scheduler core and the real ModelRunner in one
process (LocalEngine): output tokens/s with drafts verified whole (``--speculative-policy
fixed``) at k = 3, 5, 7, and the adaptive policy drafting up to the largest k, against no
speculation (the baseline, measured in the same run), per workload, concurrency and draft source,
with each run's acceptance (accepted / drafted) and mean accepted drafts per verification. The
adaptive rows also give their ratio to the best fixed k and to fixed k=5, and the end of the
report checks the targets speculative decoding was built to (docs/speculative-decoding.md).

A run sends every request of its workload (at least ``--queue`` x ``concurrency`` of them, the
workload's messages in turn) at once to an engine that runs at most ``concurrency`` at a time,
greedy, to their natural end or ``--max-tokens``. With ``--queue 1`` a run at 16 or 32 is one
wave: it lasts as long as its slowest request, so drafts that speed up some rows gain little
(the policy maximizes tokens per second of step time, which is what steady traffic turns into
throughput); ``--queue 3`` keeps the engine full as requests finish. A run has at least
``--min-requests`` requests, so that a workload of few short replies still lasts long enough to
time. Each run is a fresh engine; the start-up profile is taken once per workload and
concurrency, as a worker takes it once at start. The adaptive policy's first run starts from that
profile and no acceptance record; each later round's starts where the round before left it (its
acceptance counts by source, match length and position, and its fitted step times), as a
scheduler that has served such traffic for a while has them: a run of a few hundred tokens is
short beside the counts' learning, and a server spends most of its life warm. Requests' own
records start anew (every request is). ``--cold`` starts every run from nothing instead. Every
run goes once per round, the order
reversed every other round, and its best of ``--repeat`` rounds counts: the machine's speed
drifts over minutes (identical runs here differ by up to 20%), and interleaving spreads that over
every run alike, while the fastest of several runs is the one least slowed by the machine.

Sources: ``ngram`` (prompt lookup) on every workload; ``prediction`` (OpenAI Predicted Outputs)
where a client would have one: for code-edit, the snippet with the edit done, as an editor sends
it; ``oracle``, a prediction that is the text this model writes (sent as text, re-tokenized):
what the source gives when the prediction is right; and ``wrong``, another request's prediction
(a client that sends the wrong file): what a prediction costs when nothing in it holds.
Workloads: bench/spec_workloads.py. Every run's tokens are checked against the baseline's: in
fp32 (the default) speculation must change none; in another format (``--dtype auto`` is what a
worker serves: int8 on a CPU with the kernels) a verification's rows go through the matmuls
batched, whose rounding differs from one row's (a 4-row int8 product rounds its activations to
int16), so the report gives the share of requests whose tokens match instead.

    python bench/spec_decode.py                     # every workload, concurrency 1, 4, 16, 32
    python bench/spec_decode.py --quick             # smoke run (tests/unit/worker/test_bench_spec_decode.py)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from spec_workloads import WORKLOADS

from deepinfer.local_engine import LocalEngine
from libs.modelfiles.registry import resolve_model_path
from libs.models.llama import LlamaForCausalLM
from libs.protocol.member_messages import StepSample
from libs.protocol.messages import SamplingParams
from libs.recipe.chat_template import render_chat
from libs.recipe.tokenizer import Tokenizer
from services.scheduler.spec_policy import VerifyPolicy
from services.scheduler.worker_scheduler import Limits
from services.worker.model_loading import load_llama_model, resolve_dtype, resolve_format
from services.worker.model_runner import ModelRunner, ModelShape
from services.worker.step_profile import profile_steps

Request = tuple[list[int], list[int] | None]  # prompt, prediction
NUM_BLOCKS, BLOCK_SIZE = 2048, 16


@dataclass(frozen=True, slots=True)
class Config:
    source: str  # none | ngram | prediction | oracle
    k: int
    policy: str  # fixed | adaptive

    @property
    def label(self) -> str:
        return "-" if not self.k else str(self.k) if self.policy == "fixed" else f"adapt<={self.k}"


@dataclass(frozen=True, slots=True)
class Result:
    seconds: float
    outputs: dict[str, list[int]]
    num_drafted: int
    num_accepted: int
    num_verified: int

    @property
    def speed(self) -> float:
        """Output tokens/s (its own tokens: outside fp32 a run may end a request elsewhere)."""
        return sum(len(tokens) for tokens in self.outputs.values()) / self.seconds


@dataclass(frozen=True, slots=True)
class Row:
    workload: str
    concurrency: int
    config: Config
    speed: float  # output tokens/s
    vs_none: float


def requests(tokenizer: Tokenizer, workload: str, num_requests: int, num_tasks: int) -> list[Request]:
    """At least ``num_requests`` requests, the workload's first ``num_tasks`` messages in turn."""
    assert tokenizer.chat_template is not None
    tasks = WORKLOADS[workload][:num_tasks]
    out: list[Request] = []
    for i in range(max(num_requests, len(tasks))):
        task = tasks[i % len(tasks)]
        text = render_chat(tokenizer.chat_template, [{"role": "user", "content": task.message}])
        prediction = tokenizer.encode(task.prediction, add_bos=False) if task.prediction else None
        out.append((tokenizer.encode(text), prediction))
    return out


def new_runner(model: LlamaForCausalLM) -> ModelRunner:
    dtype = model.norm.weight.dtype  # the activations' (int8 / int4 layers keep their own)
    return ModelRunner(model, ModelShape.of(model.config), NUM_BLOCKS, BLOCK_SIZE, dtype)


def run(
    model: LlamaForCausalLM, batch: list[Request], concurrency: int, config: Config, max_tokens: int,
    profile: tuple[StepSample, ...] = (), warm: VerifyPolicy | None = None,
) -> tuple[Result, VerifyPolicy]:  # fmt: skip
    """One fresh engine over the whole batch, timed from the first submit to the last token, and
    its speculative policy as the run left it; ``profile``: the step times measured at start
    (services/worker/step_profile.py); ``warm``: a policy whose acceptance counts and step-time
    fit the run starts from (an earlier run's)."""
    cfg = model.config
    limits = Limits(
        NUM_BLOCKS, BLOCK_SIZE, concurrency, cfg.max_position_embeddings, 2048, len(batch), 0.0,
        speculative_method="ngram" if config.source == "ngram" else "none",
        num_speculative_tokens=config.k, speculative_policy=config.policy,
    )  # fmt: skip
    runner = new_runner(model)
    assert cfg.eos_token_id is not None
    engine = LocalEngine(runner, limits, cfg.eos_token_id, step_profile=profile if config.k else ())
    if warm is not None:
        engine.core.speculator.policy = VerifyPolicy(config.policy, warm.predictor, warm.step_time)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    for i, (prompt, prediction) in enumerate(batch):
        engine.add(
            f"r{i}", prompt, params, prediction_token_ids=prediction if config.source != "ngram" else None
        )
    outputs = engine.run()
    seconds = time.perf_counter() - start
    speculator = engine.core.speculator
    stats = speculator.stats["ngram" if config.source == "ngram" else "prediction"]
    result = Result(seconds, outputs, stats.num_drafted, stats.num_accepted, stats.num_verified)
    return result, speculator.policy


def bench_group(
    model: LlamaForCausalLM, tokenizer: Tokenizer, workload: str, concurrency: int, ks: list[int],
    max_tokens: int, repeat: int, num_tasks: int, num_requests: int, cold: bool,
) -> tuple[list[Row], int, int]:  # fmt: skip
    """Print one workload and concurrency's rows; returns them, how many speculative runs'
    requests' tokens differed from the baseline's, and how many such requests ran."""
    batch = requests(tokenizer, workload, num_requests, num_tasks)
    # Warm-up at this batch's shapes, drafted rows included (a forward's first run of a shape is slow).
    run(model, [(p, p[-32:]) for p, _ in batch], concurrency, Config("prediction", max(ks), "fixed"), 8)
    profile = profile_steps(new_runner(model), concurrency)
    base, _ = run(model, batch, concurrency, Config("none", 0, "fixed"), max_tokens)
    sources = ["ngram"]
    batches = {"ngram": batch, "prediction": batch}
    if any(prediction for _, prediction in batch):
        sources += ["prediction", "oracle", "wrong"]
        # the text this model writes, as a client would send it
        batches["oracle"] = [
            (prompt, tokenizer.encode(tokenizer.decode(base.outputs[f"r{i}"]), add_bos=False))
            for i, (prompt, _) in enumerate(batch)
        ]
        # another request's prediction: a client that sends the wrong file
        batches["wrong"] = [(prompt, batch[(i + 1) % len(batch)][1]) for i, (prompt, _) in enumerate(batch)]
        if len({tuple(p or ()) for _, p in batch}) < 2:
            sources.remove("wrong")
    configs = [Config("none", 0, "fixed")] + [
        Config(source, k, policy)
        for source in sources
        for k, policy in [(k, "fixed") for k in ks] + [(max(ks), "adaptive")]
    ]
    best: dict[Config, Result] = {}
    policies: dict[Config, VerifyPolicy] = {}  # each adaptive run's policy as its last round left it
    mismatches = num_checked = 0
    for round_index in range(repeat):
        for config in configs if round_index % 2 == 0 else configs[::-1]:
            source_batch = batches.get(config.source, batch)
            warm = None if cold else policies.get(config)
            result, policy = run(model, source_batch, concurrency, config, max_tokens, profile, warm)
            if config.policy == "adaptive":
                policies[config] = policy
            if config.k:  # (the baseline's own reruns say nothing about speculation)
                mismatches += sum(result.outputs[r] != tokens for r, tokens in base.outputs.items())
                num_checked += len(base.outputs)
            if config not in best or result.speed > best[config].speed:
                best[config] = result
    num_tokens = sum(len(tokens) for tokens in base.outputs.values())
    base_speed = best[configs[0]].speed
    rows = [Row(workload, concurrency, c, best[c].speed, best[c].speed / base_speed) for c in configs]
    for row in rows:
        config, result = row.config, best[row.config]
        line = f"{'':<14} {'':>4} {config.source:>10} {config.label:>8} {row.speed:>8.1f} {row.vs_none:>7.2f}"
        if config.k:
            line += f" {result.num_accepted / max(result.num_drafted, 1):>7.2f}"
            line += f" {result.num_accepted / max(result.num_verified, 1):>8.2f}"
        if config.policy == "adaptive":
            fixed = {
                r.config.k: r.speed
                for r in rows
                if r.config.source == config.source and r.config.policy == "fixed"
            }
            line += f" {row.speed / max(fixed.values()):>8.2f}"
            line += f" {row.speed / fixed[5]:>6.2f}" if 5 in fixed else f" {'-':>6}"
        if config.source == "none":
            line = f"{workload:<14} {concurrency:>4} {'none':>10} {'-':>8} {row.speed:>8.1f} {1.0:>7.2f}"
            line += f"  ({num_tokens} tokens)"
        print(line, flush=True)
    return rows, mismatches, num_checked


def report_targets(rows: list[Row]) -> None:
    """The issue's targets, each with what this run measured."""
    adaptive = [r for r in rows if r.config.policy == "adaptive"]

    def fixed_speeds(r: Row) -> dict[int, float]:
        return {
            f.config.k: f.speed
            for f in rows
            if (f.workload, f.concurrency, f.config.source) == (r.workload, r.concurrency, r.config.source)
            and f.config.policy == "fixed" and f.config.k
        }  # fmt: skip

    print("\ntargets (adaptive against the same workload, concurrency and source):")
    for concurrency in sorted({r.concurrency for r in adaptive}):
        at = [r for r in adaptive if r.concurrency == concurrency]
        vs_best = min(at, key=lambda r: r.speed / max(fixed_speeds(r).values()))
        vs_none = min(at, key=lambda r: r.vs_none)
        ratio = vs_best.speed / max(fixed_speeds(vs_best).values())
        print(
            f"  concurrency {concurrency:>2}: adaptive / best fixed k >= 0.98: lowest {ratio:.2f} "
            f"({vs_best.workload}, {vs_best.config.source}); adaptive / none >= 1.0: lowest "
            f"{vs_none.vs_none:.2f} ({vs_none.workload}, {vs_none.config.source})"
        )
    fives = [r for r in rows if r.config.policy == "fixed" and r.config.k == 5]
    if fives:
        top = max(fives, key=lambda r: r.vs_none)
        key = (top.workload, top.concurrency, top.config.source)
        match = [r for r in adaptive if (r.workload, r.concurrency, r.config.source) == key]
        print(
            f"  where fixed k=5 gains most over none ({top.workload}, {top.concurrency}, "
            f"{top.config.source}: {top.vs_none:.2f}x): adaptive / fixed k=5 >= 1.07: "
            f"{match[0].speed / top.speed:.2f}"
        )
    for r in adaptive:
        if r.workload == "code-edit" and r.concurrency == 1:
            print(f"  code-edit, concurrency 1, {r.config.source}: adaptive / none >= 1.8: {r.vs_none:.2f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--k", default="3,5,7", help="most drafted tokens per step, one run each")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtype",
        default="float32",
        help="weight format, as the worker's --dtype (auto: what a worker serves here); float32 "
        "checks that speculation changes no token",
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="rounds over every run; the best of each counts"
    )
    parser.add_argument("--tasks", type=int, default=8, help="each workload's first N messages")
    parser.add_argument(
        "--queue",
        type=int,
        default=1,
        help="requests per concurrency slot: 1 sends one wave (all at once at 16 and 32); more keep "
        "the engine full as requests finish, as steady traffic does",
    )
    parser.add_argument("--min-requests", type=int, default=4, help="requests per run at least")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="every adaptive run starts from no acceptance record (by default, rounds after the "
        "first start from the record the one before left)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="code-edit's first 2 messages, concurrency 1, 12 tokens, k=3, every source",
    )
    args = parser.parse_args()
    if args.quick:
        args.workloads, args.concurrency, args.k, args.max_tokens, args.repeat = "code-edit", "1", "3", 12, 1
        args.tasks, args.min_requests = 2, 2
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    cache = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    path = resolve_model_path("smollm2")
    fmt = resolve_format(args.dtype)
    model = load_llama_model(path, cache, fmt)
    tokenizer = Tokenizer.from_gguf(path, cache)
    exact = fmt == "float32"
    print(
        f"SmolLM2 {fmt} ({resolve_dtype(fmt)} activations), {args.threads} threads, "
        f"load {os.getloadavg()[0]:.1f}; max_tokens {args.max_tokens}"
    )
    print(
        f"{'workload':<14} {'conc':>4} {'source':>10} {'k':>8} {'tok/s':>8} {'x none':>7} {'accept':>7} "
        f"{'mean acc':>8} {'x best k':>8} {'x k=5':>6}"
    )
    mismatches = num_checked = 0
    rows: list[Row] = []
    ks = [int(k) for k in args.k.split(",")]
    for workload in args.workloads.split(","):
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            group, num_changed, num_ran = bench_group(
                model, tokenizer, workload, concurrency, ks, args.max_tokens, args.repeat, args.tasks,
                max(args.queue * concurrency, args.min_requests), args.cold,
            )  # fmt: skip
            rows += group
            mismatches += num_changed
            num_checked += num_ran
    report_targets(rows)
    if mismatches and exact:
        print(f"ERROR: {mismatches} of {num_checked} requests' tokens differ from the baseline's")
        sys.exit(1)
    print(
        f"speculative requests whose tokens match the baseline's: {num_checked - mismatches} of {num_checked}"
    )


if __name__ == "__main__":
    main()
