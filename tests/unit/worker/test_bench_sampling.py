"""bench/sampling.py --quick: the benchmark's smoke run. Its times are not checked; its last
column is: seeded rows draw the same uniforms on both sides, so they pick the same tokens."""

from __future__ import annotations

from tests.bench_smoke import run_quick


def test_sampling_bench_quick_runs_and_both_sides_agree() -> None:
    out = run_quick("sampling.py", "--threads", "1")
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[3:] if line.strip()]
    assert len(rows) >= 6, out.stdout
    assert all(row[-1] == "0" for row in rows), out.stdout  # "differ": rows that picked otherwise
