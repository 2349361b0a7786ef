"""bench/spec_decode.py --quick: the benchmark's smoke run (it exits 1 if speculation changed a
token; its speeds are not checked here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_spec_decode_bench_quick_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "spec_decode.py"), "--quick", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "code-edit" in out.stdout and "x none" in out.stdout
