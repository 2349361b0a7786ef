"""bench/weight_formats.py --quick: the benchmark's smoke run (its speeds and scores are not checked)."""

from __future__ import annotations

from tests.bench_smoke import run_quick


def test_weight_formats_bench_quick_runs() -> None:
    # The machine's environment: the int8 layers' CPU kernels build (or load from their cache).
    out = run_quick("weight_formats.py", "--threads", "1", inherit_env=True)
    assert out.returncode == 0, out.stderr
    for fmt in ("fp32", "bf16", "int8", "int4"):
        assert fmt in out.stdout, fmt
