"""Runs a benchmark's ``--quick`` smoke run as a subprocess, as CI does (its numbers are not checked)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_quick(script: str, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """``python bench/<script> --quick <args>`` from the repository root, its output captured."""
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--quick", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        check=False,
    )
