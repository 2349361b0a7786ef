"""bench/fleet.py --quick end to end (real processes, real nats-server, SmolLM2): it exits 0 and
prints each ratio with a measured value. No figure is asserted: this machine is shared."""

from __future__ import annotations

import re
from pathlib import Path

from tests.bench_smoke import run_quick

MEASURED = r"(\d+\.\d+x|infx)"
RATIO_LINES = (
    rf"^ratio kv/round_robin G1\+G2 hit rate: {MEASURED} \(target >= 3\.0x\)$",
    rf"^ratio kv/round_robin TTFT p50: {MEASURED} \(target <= 0\.4x\)$",
    r"^kv max/min prompt tokens computed per worker: (\d+\.\d+x|infx|n/a) \(target <= 1\.3x\)$",
    rf"^ratio migration kill->next token p50 / ITL before: {MEASURED} \(reported\)$",
    rf"^ratio pd/colocated decode ITL p99: {MEASURED} \(target <= 0\.5x\)$",
)


def test_quick_fleet_bench_exits_0_and_prints_its_ratios(model_cache_dir: Path) -> None:
    proc = run_quick("fleet.py", "--cache-dir", str(model_cache_dir), timeout_s=900, inherit_env=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for pattern in RATIO_LINES:
        assert re.search(pattern, proc.stdout, re.MULTILINE), (pattern, proc.stdout[-4000:])
    assert "problems: none" in proc.stdout
