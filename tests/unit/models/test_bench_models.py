"""bench/models.py --quick: the benchmark's smoke run (its numbers are not checked here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_models_bench_quick_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "models.py"), "--quick", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "decode x8 @ ctx 256" in out.stdout and "routed/dense" in out.stdout
