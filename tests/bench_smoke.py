"""Runs a benchmark's ``--quick`` smoke run as a subprocess, as CI does (its numbers are not checked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_quick(
    script: str, *args: str, timeout_s: float = 300, inherit_env: bool = False
) -> subprocess.CompletedProcess[str]:
    """``python bench/<script> --quick <args>`` from the repository root, its output captured. The
    environment is bare unless ``inherit_env`` (a bench that starts the stack needs ``PATH``: its
    worker builds the CPU kernels with the machine's compiler)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)} if inherit_env else {"PYTHONPATH": str(ROOT), "PATH": ""}
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--quick", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        env=env,
        check=False,
    )
