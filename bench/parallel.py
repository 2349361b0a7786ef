"""Tensor parallelism's cost on this machine: a step's time with one rank and with two (the
worker's own executor: rank 0 in this process, rank 1 a process of its own), the two ranks'
all-reduces through shared memory (the default on one CPU node) and through gloo alone, and the
bytes each collective moves per step.

    python bench/parallel.py                                  # SmolLM2: fp32 and int8
    python bench/parallel.py --model DIR --expert-parallel    # a DeepSeek-V3-family checkpoint
    python bench/parallel.py --quick    # smoke run (tests/unit/worker/test_bench_parallel.py)

Two CPU cores cannot show a speed-up. One rank runs its products on both cores; two ranks get a
core each, so a step computes the same on the same cores, and adds per layer two all-reduces of
the hidden states, per step a command broadcast and a gather of the logits (both over gloo).
What the numbers show is that overhead, and the bytes behind it: for a decode token, two
all-reduces of one hidden vector per layer, which NVLink moves in microseconds.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from libs.models import shm_all_reduce
from libs.runtime.settings import resolve_cache_dir
from services.worker.config import Config
from services.worker.forward_executor import ForwardBatch
from services.worker.main import Worker, build_worker
from services.worker.parallel_executor import ParallelExecutor

CONTEXT = 256  # tokens each decode row attends over
SUPPORTED = shm_all_reduce.supported


@contextmanager
def worker(model: str, dtype: str, tp: int, expert_parallel: bool, cache_dir: str) -> Iterator[Worker]:
    config = Config(
        model=model,
        dtype=dtype,
        tensor_parallel_size=tp,
        expert_parallel=expert_parallel and tp > 1,
        kv_cache_gb=0.6,
        host_cache_gb=0,
        kv_store_path="none",
    )
    threads = torch.get_num_threads()
    built = build_worker(config, cache_dir, profile=False)
    built.runner.grammars.wait_warm()  # compiler processes still warming take the cores from a step
    try:
        yield built
    finally:
        built.close()
        torch.set_num_threads(threads)


def steps(block_size: int, decode_rows: list[int], prefill_tokens: int) -> dict[str, ForwardBatch]:
    """Decode steps of n rows over CONTEXT cached tokens each, and one prefill (pages: any; a
    step's cost does not depend on what they hold)."""
    per_row = -(-(CONTEXT + 1) // block_size)
    out = {}
    for n in decode_rows:
        tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(n)]
        out[f"decode x{n}"] = ForwardBatch(
            [17] * n, [CONTEXT] * n, [1] * n, [CONTEXT] * n, tables, list(range(n))
        )
    num_blocks = -(-prefill_tokens // block_size)
    out[f"prefill {prefill_tokens}"] = ForwardBatch(
        [17] * prefill_tokens,
        list(range(prefill_tokens)),
        [prefill_tokens],
        [0],
        [list(range(num_blocks))],
        [prefill_tokens - 1],
    )
    return out


def time_steps(
    built: Worker, batches: dict[str, ForwardBatch], repeat: int
) -> dict[str, tuple[float, dict[str, float]]]:
    """Per step: the median seconds, and the bytes per step rank 0 handed to each collective."""
    executor = built.runner.executor
    tp = executor.tp if isinstance(executor, ParallelExecutor) else None
    out = {}
    with torch.inference_mode():
        for name, batch in batches.items():
            executor.forward(batch)  # warm
            before = dict(tp.num_bytes) if tp is not None else {}
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                executor.forward(batch)
                times.append(time.perf_counter() - start)
            moved = {k: (tp.num_bytes[k] - before[k]) / repeat for k in before} if tp is not None else {}
            if tp is not None:
                moved["command"] = len(pickle.dumps(batch))
            out[name] = (statistics.median(times), moved)
    return out


def measure(
    args: argparse.Namespace, dtype: str, cache_dir: str
) -> dict[str, dict[str, tuple[float, dict[str, float]]]]:
    """Per setting (one rank; two with the shared-memory all-reduce; two with gloo's alone): per step."""
    rows, prefill, repeat = ([1], 32, 2) if args.quick else ([1, 8, 32], 512, args.repeat)
    results = {}
    for label, tp, shm in (("tp1", 1, False), ("tp2", 2, True), ("tp2-gloo", 2, False)):
        # Rank 0 decides for its group whether the shared-memory path is used.
        shm_all_reduce.supported = (lambda: True) if shm else (lambda: False)  # type: ignore[assignment]
        with worker(args.model, dtype, tp, args.expert_parallel, cache_dir) as built:
            results[label] = time_steps(built, steps(built.runner.block_size, rows, prefill), repeat)
    shm_all_reduce.supported = SUPPORTED  # type: ignore[assignment]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtypes", default="float32,int8", help="weight formats, comma-separated")
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a smoke run: fp32, two steps, 2 repeats")
    args = parser.parse_args()
    if not SUPPORTED():
        raise SystemExit("the shared-memory all-reduce needs x86-64 and /dev/shm")
    cache_dir = resolve_cache_dir("", os.environ)
    print(f"# step time, 1 rank vs 2 ranks ({args.model}; {torch.get_num_threads()} CPU threads in all)")
    print(
        f"{'format':>8} {'step':>12} {'TP=1 ms':>8} {'TP=2 ms':>8} {'TP2/TP1':>8} {'gloo ms':>8}"
        f" {'gloo/TP1':>9} {'all-reduce KiB':>15} {'gather KiB':>11} {'command B':>10}"
    )
    for dtype in ["float32"] if args.quick else args.dtypes.split(","):
        results = measure(args, dtype, cache_dir)
        for name, (one, _) in results["tp1"].items():
            two, moved = results["tp2"][name]
            gloo, _ = results["tp2-gloo"][name]
            print(
                f"{dtype:>8} {name:>12} {one * 1e3:8.1f} {two * 1e3:8.1f} {two / one:8.2f} {gloo * 1e3:8.1f}"
                f" {gloo / one:9.2f} {moved['all_reduce'] / 1024:15.1f} {moved['gather'] / 1024:11.1f}"
                f" {moved['command']:10.0f}"
            )


if __name__ == "__main__":
    main()
