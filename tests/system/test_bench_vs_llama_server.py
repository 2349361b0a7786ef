"""bench/vs_llama_server.py --quick end to end (`deepinfer serve`, real nats-server, SmolLM2; no
llama-server): it exits 0 and prints its table and the first-request check with measured values.
No figure is asserted: this machine is shared."""

from __future__ import annotations

import re
from pathlib import Path

from tests.bench_smoke import run_quick


def test_quick_bench_exits_0_and_prints_its_rows(model_cache_dir: Path) -> None:
    proc = run_quick(
        "vs_llama_server.py", "--cache-dir", str(model_cache_dir), timeout_s=600, inherit_env=True
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert re.search(r"^deepinfer\s+2\s+\d+\.\d( +\d+){4}$", proc.stdout, re.MULTILINE), proc.stdout
    first = r"^  deepinfer: first request's TTFT \d+ ms / median \d+ ms = \d+\.\d+x \(target <= 2\.0x\) "
    first += r"(met|MISSED)$"
    assert re.search(first, proc.stdout, re.MULTILINE), proc.stdout
