"""bench/vs_llama_server.py --quick end to end (`deepinfer serve`, real nats-server, SmolLM2; no
llama-server): it exits 0 and prints its table and the first-request check with measured values.
No figure is asserted: this machine is shared."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_bench_exits_0_and_prints_its_rows(model_cache_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "bench/vs_llama_server.py", "--quick", "--cache-dir", str(model_cache_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert re.search(r"^deepinfer\s+2\s+\d+\.\d( +\d+){4}$", proc.stdout, re.MULTILINE), proc.stdout
    first = r"^  deepinfer: first request's TTFT \d+ ms / median \d+ ms = \d+\.\d+x \(target <= 2\.0x\) "
    first += r"(met|MISSED)$"
    assert re.search(first, proc.stdout, re.MULTILINE), proc.stdout
