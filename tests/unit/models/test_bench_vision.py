"""bench/vision.py --quick: the benchmark's smoke run (its times are not checked)."""

from __future__ import annotations

from tests.bench_smoke import run_quick


def test_vision_bench_quick_runs() -> None:
    out = run_quick("vision.py", inherit_env=True)
    assert out.returncode == 0, out.stderr
    assert "tower + projector, batch 4" in out.stdout
    assert "| encoder hit |" in out.stdout and "| both hit |" in out.stdout
