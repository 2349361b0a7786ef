"""llama.cpp on the same GGUF as a speed peer: greedy decode of N prompts at once, tokens/s.

    pip install llama-cpp-python==0.3.36   # optional, benchmark only; builds from source (~6+ min)
    python bench/llamacpp_baseline.py [--concurrency 1,8,32,64] [--max-tokens 128] [--threads 2]

Uses llama-cpp-python's low-level API, as a serving loop would: one context whose KV cache holds
N sequences (one stream each), the prompts prefilled in batches of up to `n_batch` tokens, then one
`llama_decode` per step with one token per sequence and a greedy argmax over each row of logits.
Tokens/s counts every generated token (the first one comes from the prefill) over the wall time
of prefill plus decode, the same definition bench/throughput.py uses for the other engines.

llama.cpp quantizes activations, so its tokens differ from the torch engines'; it is a speed
peer only, never a correctness reference. Without the package installed, `available()` says why.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

PREFILL_BATCH = 512  # tokens per prefill llama_decode call


@dataclass(frozen=True, slots=True)
class Run:
    num_seqs: int
    num_tokens: int  # generated, over all sequences
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds


def import_llama_cpp() -> ModuleType | None:
    try:
        return importlib.import_module("llama_cpp")  # optional, benchmark-only
    except ImportError:
        return None


def available() -> str | None:
    """None when llama-cpp-python is importable, else a sentence saying how to get it."""
    if import_llama_cpp() is None:
        return "llama-cpp-python is not installed (optional: pip install llama-cpp-python==0.3.36)"
    return None


class LlamaCppBaseline:
    """One loaded GGUF; `generate` builds a context sized for its N sequences and frees it after."""

    def __init__(self, path: Path, num_threads: int, quiet: bool = True) -> None:
        lib = import_llama_cpp()
        if lib is None:
            raise RuntimeError(available())
        self.lib: Any = lib
        if quiet:
            # keep a reference: llama.cpp calls it for the life of the process
            self._log_callback = lib.llama_log_callback(lambda level, text, user_data: None)
            lib.llama_log_set(self._log_callback, ctypes.c_void_p())
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model)))
        self.num_threads = num_threads

    def system_info(self) -> str:
        return bytes(self.lib.llama_print_system_info()).decode(errors="replace").strip()

    def close(self) -> None:
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None

    def generate(self, prompts: list[list[int]], max_tokens: int) -> Run:
        """Greedy: every prompt gets exactly `max_tokens` new tokens (EOS ignored)."""
        lib, n = self.lib, len(prompts)
        ctx_params = lib.llama_context_default_params()
        # one KV stream per sequence (not unified): a step attends over each sequence's own cells,
        # not over every cell in use, which keeps llama.cpp's many-sequence steps fast
        per_seq = -(-(max(len(p) for p in prompts) + max_tokens + 16) // 256) * 256
        ctx_params.n_ctx = n * per_seq
        ctx_params.n_batch = ctx_params.n_ubatch = max(PREFILL_BATCH, n)
        ctx_params.n_seq_max = n
        ctx_params.kv_unified = False
        ctx_params.n_threads = ctx_params.n_threads_batch = self.num_threads
        ctx_params.no_perf = True
        ctx = lib.llama_init_from_model(self.model, ctx_params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {n} sequences")
        batch = lib.llama_batch_init(ctx_params.n_batch, 0, 1)
        try:
            start = time.perf_counter()
            last = self._prefill(ctx, batch, prompts)
            positions = [len(p) for p in prompts]
            for _ in range(max_tokens - 1):
                self._fill(batch, [(s, last[s], positions[s], True) for s in range(n)])
                self._decode(ctx, batch)
                last = self._argmax(ctx, n)
                positions = [p + 1 for p in positions]
            seconds = time.perf_counter() - start
        finally:
            lib.llama_batch_free(batch)
            lib.llama_free(ctx)
        return Run(n, n * max_tokens, seconds)

    def _prefill(self, ctx: Any, batch: Any, prompts: list[list[int]]) -> list[int]:
        """Feed every prompt (packed into batches of up to n_batch tokens); the first sampled token each."""
        entries = [
            (seq, token, pos, pos == len(prompt) - 1)
            for seq, prompt in enumerate(prompts)
            for pos, token in enumerate(prompt)
        ]
        first: list[int] = [0] * len(prompts)
        for i in range(0, len(entries), PREFILL_BATCH):
            chunk = entries[i : i + PREFILL_BATCH]
            self._fill(batch, chunk)
            self._decode(ctx, batch)
            ending = [seq for seq, _, _, wants_logits in chunk if wants_logits]
            for seq, token in zip(ending, self._argmax(ctx, len(ending)), strict=True):
                first[seq] = token
        return first

    @staticmethod
    def _fill(batch: Any, entries: list[tuple[int, int, int, bool]]) -> None:
        for i, (seq, token, pos, wants_logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = wants_logits
        batch.n_tokens = len(entries)

    def _decode(self, ctx: Any, batch: Any) -> None:
        rc = self.lib.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, ctx: Any, num_rows: int) -> list[int]:
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits(ctx), shape=(num_rows, self.n_vocab))
        return [int(t) for t in logits.argmax(axis=1)]


def sweep(
    path: Path,
    prompts: list[list[int]],
    concurrency: list[int],
    max_tokens: int,
    num_threads: int,
    repeats: int = 1,
) -> tuple[dict[int, Run], str]:
    """Per level N: a 2-token warm-up, then `repeats` runs over the first N prompts, the best kept;
    also llama.cpp's system info (the CPU features it was built with)."""
    engine = LlamaCppBaseline(path, num_threads)
    try:
        runs = {}
        for n in concurrency:
            engine.generate(prompts[:n], 2)
            tries = [engine.generate(prompts[:n], max_tokens) for _ in range(repeats)]
            runs[n] = max(tries, key=lambda r: r.tokens_per_s)
        return runs, engine.system_info()
    finally:
        engine.close()


def main() -> None:
    import os

    from prompts import chat_prompts  # the prompts every engine in bench/throughput.py gets

    from libs.modelfiles.registry import resolve_model_path
    from libs.runtime.settings import resolve_cache_dir
    from services.gateway.served_model import ServedModel

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="1,8,32,64", help="comma-separated numbers of sequences")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a .gguf path")
    args = parser.parse_args()
    reason = available()
    if reason is not None:
        raise SystemExit(f"skipped: {reason}")
    levels = [int(c) for c in args.concurrency.split(",")]
    served = ServedModel.load(args.model, resolve_cache_dir("", os.environ), "", 0)
    prompts = chat_prompts(served, max(levels))
    runs, info = sweep(resolve_model_path(args.model), prompts, levels, args.max_tokens, args.threads)
    print(f"llama.cpp: {info}")
    print(f"{'seqs':>5} {'tok/s':>8}")
    for n, run in runs.items():
        print(f"{n:>5} {run.tokens_per_s:>8.1f}")


if __name__ == "__main__":
    main()
