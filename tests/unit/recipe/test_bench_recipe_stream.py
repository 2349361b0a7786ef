"""bench/recipe_stream.py --quick: the benchmark's smoke run (its rates are not checked)."""

from __future__ import annotations

from tests.bench_smoke import run_quick


def test_recipe_stream_bench_quick_runs() -> None:
    out = run_quick("recipe_stream.py")
    assert out.returncode == 0, out.stderr
    assert "SmolLM2, plain content (500 tokens)" in out.stdout and "x baseline" in out.stdout
