"""Sampler cost per step: services.worker.sampler.Sampler vs the plain-torch ``sample_ref`` pipeline.

    python bench/sampling.py [--vocab 49152] [--budget-s 0.4] [--threads N]
    python bench/sampling.py --quick     # smoke run: 0.01 s a line (tests/unit/worker/test_bench_sampling.py)

Cases: (a) all greedy; (b) temperature 0.8 + top_p 0.9; (c) top_k 40 + min_p 0.05 + repetition,
presence and frequency penalties over a 512-token prompt and 64 outputs + logprobs with 5
alternatives. Rows in (b) and (c) are seeded, so both sides draw with the same uniforms and must
pick the same tokens; the last column counts rows where they do not.

Logits are LLM-shaped: N(0, 1) noise plus a head of 20 tokens raised by U(8, 14), so the head
holds nearly all the mass and the top-p nucleus is a few tokens. Each line prints ms per call
(median and min of the calls that fit the time budget) for both sides and the ratio of the
medians (reference / sampler). With other work on the machine, ``--threads 1`` gives steadier
numbers: a busy core stalls every multi-threaded op at its barrier.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from libs.kernels.sampling import sample_ref, uniform_from_seed
from libs.protocol.messages import SamplingParams
from services.worker.sampler import Sampler
from services.worker.sequence_state import SequenceState

ROWS = (1, 8, 32, 64)
CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temp+top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k+min_p+pen+lp": SamplingParams(
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        logprobs=True,
        top_logprobs=5,
    ),
}


def llm_like_logits(num_rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    logits = torch.randn(num_rows, vocab, generator=g)  # [rows, vocab]
    head = torch.randint(0, vocab, (num_rows, 20), generator=g)
    logits.scatter_add_(1, head, 8.0 + 6.0 * torch.rand(num_rows, 20, generator=g))
    return logits


def make_seqs(params: SamplingParams, num_rows: int, vocab: int, g: torch.Generator) -> list[SequenceState]:
    seqs = []
    for i in range(num_rows):
        tokens = torch.randint(0, vocab, (512 + 64,), generator=g).tolist()
        row_params = params if params.greedy else dataclasses.replace(params, seed=1000 + i)
        seqs.append(SequenceState(f"s{i}", tokens, 512, row_params, frozenset({0}), [], 0))
    return seqs


def reference(logits: torch.Tensor, seqs: list[SequenceState]) -> list[int]:
    """The plain pipeline: sample_ref, plus full-vocab logprobs when rows ask for them."""
    uniforms = torch.tensor(
        [uniform_from_seed(s.sampling_params.seed or 0, s.num_output_tokens) for s in seqs],
        dtype=torch.float64,
    )
    token_ids = sample_ref(logits, seqs, uniforms)
    if seqs[0].sampling_params.logprobs:
        logprobs = torch.log_softmax(logits, dim=-1)
        logprobs.gather(1, token_ids[:, None]).tolist()
        logprobs.topk(seqs[0].sampling_params.top_logprobs, dim=-1)[0].tolist()
    result: list[int] = token_ids.tolist()
    return result


def time_ms(fn: Callable[[], object], budget_s: float) -> tuple[float, float]:
    """(median, min) ms of the calls that fit in budget_s (at least 3, after one warm-up call)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def bench_line(sampler: Sampler, params: SamplingParams, num_rows: int, vocab: int, budget_s: float) -> str:
    g = torch.Generator().manual_seed(num_rows)
    logits = llm_like_logits(num_rows, vocab, g)
    seqs = make_seqs(params, num_rows, vocab, g)
    expected = reference(logits, seqs)
    differ = sum(a != b for a, b in zip(sampler(logits.clone(), seqs).token_ids, expected, strict=True))
    # The sampler may penalise its logits in place; the same tensor again costs the same.
    scratch = logits.clone()
    fast_ms, fast_min = time_ms(lambda: sampler(scratch, seqs), budget_s)
    ref_ms, ref_min = time_ms(lambda: reference(logits, seqs), budget_s)
    return (
        f"{num_rows:4d} {fast_ms:8.2f} {fast_min:8.2f} {ref_ms:9.2f} {ref_min:9.2f}"
        f" {ref_ms / fast_ms:7.1f}x {differ:6d}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--budget-s", type=float, default=0.4, help="timing budget per line and side")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a 0.01 s budget per line and side")
    args = parser.parse_args()
    if args.quick:
        args.budget_s = 0.01
    if args.threads:
        torch.set_num_threads(args.threads)
    sampler = Sampler(seed=0)
    print(f"vocab={args.vocab} threads={torch.get_num_threads()}")
    print("ms per call: median and min of each side; ratio of the medians (reference / sampler)")
    header = ["rows", "sampler", "min", "reference", "min", "ratio", "differ"]
    print(
        f"{'case':20s} {' '.join(f'{h:>{w}s}' for h, w in zip(header, [4, 8, 8, 9, 9, 8, 6], strict=True))}"
    )
    with torch.inference_mode():
        for name, params in CASES.items():
            for num_rows in ROWS:
                print(
                    f"{name:20s} {bench_line(sampler, params, num_rows, args.vocab, args.budget_s)}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
