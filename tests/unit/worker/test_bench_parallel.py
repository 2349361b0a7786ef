"""bench/parallel.py --quick: the benchmark's smoke run (its times are not checked)."""

from __future__ import annotations

from tests.bench_smoke import run_quick


def test_parallel_bench_quick_runs() -> None:
    # The machine's environment: the worker's CPU kernels build (or load from their cache).
    out = run_quick("parallel.py", inherit_env=True)
    assert out.returncode == 0, out.stderr
    assert "decode x1" in out.stdout and "prefill 32" in out.stdout
    assert "TP2/TP1" in out.stdout
