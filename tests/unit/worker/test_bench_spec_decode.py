"""bench/spec_decode.py --quick: the benchmark's smoke run (it exits 1 if speculation changed a
token; its speeds are not checked here)."""

from __future__ import annotations

from tests.bench_smoke import run_quick


def test_spec_decode_bench_quick_runs() -> None:
    out = run_quick("spec_decode.py", "--threads", "1")
    assert out.returncode == 0, out.stderr
    assert "code-edit" in out.stdout and "x none" in out.stdout
