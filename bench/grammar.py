"""Grammar backends over the schema corpus (tests/grammar_corpus.py) and SmolLM2's vocabulary:
xgrammar against outlines (the baseline), and a GrammarCache hit against a cold compile.

    python bench/grammar.py [--repeats 3] [--walks 2]

Per backend, over the schemas it accepts (ratios only over the schemas both accept):
- compile, cold: ``backend.compile`` of each schema, ``--repeats`` times, p50 / p99. Cold means
  no cache anywhere: the xgrammar backend's GrammarCompiler always runs with cache_enabled=False
  (GrammarCache is the only cache), and outlines-core keeps none (regex, DFA and index are rebuilt).
- compile, cached: ``GrammarCache.get`` of a schema it already holds (a dict hit and a done future).
- validate: the gateway's check of the same constraint (no vocabulary).
- mask fill: ``Matcher.fill_mask`` at every step of ``--walks`` random masked walks per schema
  (tests/unit/grammar/walk.py: only allowed tokens, steered to finish), µs per call.
- way out: ``completion_path`` (what the worker searches when a constrained output nears its
  max_tokens) at every step of the same walks, ms per search, and how many found none.
Ratios are outlines / xgrammar: above 1, xgrammar is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ is not an installed package

from libs.grammar import BACKENDS, make_backend, validate
from libs.grammar.backend import GrammarBackend, GrammarError, Matcher
from libs.grammar.cache import GrammarCache
from libs.grammar.completion import Alphabet, completion_path
from libs.modelfiles.registry import resolve_model_path
from libs.protocol.messages import StructuredOutput, StructuredOutputKind
from libs.recipe.tokenizer import Tokenizer
from tests.grammar_corpus import SCHEMAS
from tests.unit.grammar.walk import WalkVocab, walk

VOCAB_SIZE = 49152  # SmolLM2's logits width
Stats = dict[str, list[float]]  # metric -> samples (seconds)


class TimedMatcher:
    """A matcher that records how long each fill_mask takes, and how long a search for a way out
    of the grammar takes from the same state (``stats["none"]``: one entry per search that found none)."""

    def __init__(self, matcher: Matcher, stats: Stats, alphabet: Alphabet, stop_id: int) -> None:
        self.matcher = matcher
        self.stats = stats
        self.alphabet = alphabet
        self.stop_id = stop_id

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        start = time.perf_counter()
        self.matcher.fill_mask(bitmask, row)
        self.stats["fill"].append(time.perf_counter() - start)
        start = time.perf_counter()
        path = completion_path(self.matcher, self.alphabet, self.stop_id)
        self.stats["way_out"].append(time.perf_counter() - start)
        if path is None:
            self.stats["none"].append(1.0)

    def advance(self, token_id: int) -> bool:
        return self.matcher.advance(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def state_key(self) -> object:
        return self.matcher.state_key()


def load_vocab(cache_dir: Path) -> tuple[list[bytes], tuple[int, ...]]:
    tokenizer = Tokenizer.from_gguf(resolve_model_path("smollm2"), cache_dir)
    special = tokenizer.special_token_ids
    vocab = [b"" if i in special else tokenizer.token_bytes(i) for i in range(VOCAB_SIZE)]
    assert tokenizer.eos_token_id is not None
    return vocab, (tokenizer.eos_token_id, 0, 1)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def per_call(fn: Callable[[], object], calls: int = 2000) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(
    backend: GrammarBackend,
    names: Sequence[str],
    vocab: WalkVocab,
    stop_ids: tuple[int, ...],
    args: argparse.Namespace,
) -> Stats:
    stats: Stats = {"compile": [], "cached": [], "validate": [], "fill": [], "way_out": [], "none": []}
    alphabet = Alphabet.of(vocab.tokens)
    schemas = {entry.name: entry.schema for entry in SCHEMAS}
    cache = GrammarCache(backend, max_entries=len(names))
    for name in names:
        constraint = StructuredOutput(
            StructuredOutputKind.JSON_SCHEMA, json.dumps(schemas[name]), backend.name
        )
        for _ in range(args.repeats):
            stats["compile"].append(timed(partial(backend.compile, constraint)))
        stats["validate"].append(timed(partial(validate, constraint)))
        compiled = cache.get(constraint)
        stats["cached"].append(per_call(partial(cache.get, constraint)))
        for seed in range(args.walks):
            matcher = TimedMatcher(compiled.matcher(stop_ids), stats, alphabet, stop_ids[0])
            walk(matcher, vocab, stop_ids, random.Random(seed))
    cache.close()
    return stats


def accepted_by(backend: str) -> list[str]:
    names = []
    for entry in SCHEMAS:
        try:
            validate(StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(entry.schema), backend))
            names.append(entry.name)
        except GrammarError:
            pass
    return names


def quantile(samples: list[float], q: float) -> float:
    return (
        statistics.quantiles(samples, n=100, method="inclusive")[round(q * 100) - 1]
        if q < 1
        else max(samples)
    )


ROWS: list[tuple[str, str, Callable[[list[float]], float], float]] = [
    ("compile cold p50", "compile", statistics.median, 1e3),
    ("compile cold p99", "compile", lambda s: quantile(s, 0.99), 1e3),
    ("compile cached (GrammarCache hit)", "cached", statistics.median, 1e6),
    ("validate (gateway) p50", "validate", statistics.median, 1e3),
    ("validate (gateway) p99", "validate", lambda s: quantile(s, 0.99), 1e3),
    ("mask fill mean", "fill", statistics.fmean, 1e6),
    ("mask fill p50", "fill", statistics.median, 1e6),
    ("mask fill p99", "fill", lambda s: quantile(s, 0.99), 1e6),
    ("way out search p50", "way_out", statistics.median, 1e3),
    ("way out search p99", "way_out", lambda s: quantile(s, 0.99), 1e3),
]


def print_table(title: str, columns: dict[str, Stats], baseline: str | None) -> None:
    names = list(columns)
    header = f"{title:36s}" + "".join(f"{name:>14s}" for name in names)
    print(header + (f"{baseline + ' / xgrammar':>22s}" if baseline else ""))
    for label, metric, reduce, scale in ROWS:
        unit = "ms" if scale == 1e3 else "us"
        values = [reduce(columns[name][metric]) * scale for name in names]
        line = f"{label + ' ' + unit:36s}" + "".join(f"{value:14.3f}" for value in values)
        if baseline:
            line += f"{values[names.index(baseline)] / values[names.index('xgrammar')]:21.1f}x"
        print(line)
    for name in names:
        stats = columns[name]
        print(f"{name}: no way out found in {len(stats['none'])} of {len(stats['way_out'])} searches")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="cold compiles per schema")
    parser.add_argument("--walks", type=int, default=2, help="random masked walks per schema")
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "deepinfer-bench-grammar"
    )
    args = parser.parse_args()
    one, five, _ = os.getloadavg()
    print(f"load average {one:.1f} / {five:.1f} on {os.cpu_count()} cores")
    vocab, stop_ids = load_vocab(args.cache_dir)
    walk_vocab = WalkVocab.of(vocab)
    backends: dict[str, GrammarBackend] = {}
    for name in BACKENDS:
        start = time.perf_counter()
        backends[name] = make_backend(name, vocab)
        print(f"{name}: backend setup (import + vocabulary) {time.perf_counter() - start:.2f} s")
    accepted = {name: accepted_by(name) for name in BACKENDS}
    both = [name for name in accepted["xgrammar"] if name in accepted["outlines"]]
    counts = ", ".join(f"{name} accepts {len(names)}" for name, names in accepted.items())
    print(f"corpus: {len(SCHEMAS)} schemas; {counts}")
    common = {name: measure(backends[name], both, walk_vocab, stop_ids, args) for name in BACKENDS}
    print(
        f"\n{len(both)} schemas both backends accept ({args.repeats} cold compiles, {args.walks} walks each):"
    )
    print_table("", common, baseline="outlines")
    for name, stats in common.items():
        speedup = statistics.median(stats["compile"]) / statistics.median(stats["cached"])
        print(f"{name}: a GrammarCache hit is {speedup:,.0f}x faster than a cold compile (p50)")
    rest = [name for name in accepted["xgrammar"] if name not in both]
    only = measure(backends["xgrammar"], rest, walk_vocab, stop_ids, args)
    print(f"\n{len(rest)} schemas only xgrammar accepts:")
    print_table("", {"xgrammar": only}, baseline=None)


if __name__ == "__main__":
    main()
