"""bench/models.py --quick: the benchmark's smoke run (its numbers are not checked here)."""

from __future__ import annotations

from tests.bench_smoke import run_quick


def test_models_bench_quick_runs() -> None:
    out = run_quick("models.py", "--threads", "1")
    assert out.returncode == 0, out.stderr
    assert "decode x8 @ ctx 256" in out.stdout and "routed/dense" in out.stdout
