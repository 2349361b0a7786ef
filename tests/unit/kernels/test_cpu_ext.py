"""The CPU extension's build: a lock file that a killed build left behind does not stall the next
build (it runs in a subprocess: a process loads the library once)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BUILD = """
import sys
from libs.kernels import cpu_ext
cpu_ext.configure(cache_dir=sys.argv[1])
directory = cpu_ext.build_dir()
directory.mkdir(parents=True)
(directory / "lock").touch()  # torch's build lock, as a build killed mid-compile leaves it
assert cpu_ext.ops() is not None
print(sorted(p.name for p in directory.iterdir() if p.suffix == ".so"))
"""


def test_a_killed_builds_lock_does_not_stall_the_next_build(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", BUILD, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deepinfer_cpu.so" in proc.stdout
