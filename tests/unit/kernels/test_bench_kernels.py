"""bench/kernels.py --quick: the benchmark's smoke run (every op once; its times are not checked)."""

from __future__ import annotations

from tests.bench_smoke import run_quick


def test_kernels_bench_quick_runs() -> None:
    # The machine's environment: the CPU extension builds (or loads from its cache) as a worker's does.
    out = run_quick("kernels.py", "--threads", "1", inherit_env=True)
    assert out.returncode == 0, out.stderr
    for op in ("rms_norm", "rotary", "int8", "paged", "decoder_blocks"):
        assert op in out.stdout, op
