"""bench/fault_isolation.py --quick end to end (`deepinfer serve`, real nats-server, SmolLM2): it
exits 0, every bad request gets a 4xx, no canary stream is lost, the worker is not restarted and
no peer is logged as lost. Its latency ratios are printed, not asserted: this machine is shared."""

from __future__ import annotations

import re

from tests.bench_smoke import run_quick


def test_quick_bench_keeps_every_canary_and_answers_bad_requests_with_4xx() -> None:
    proc = run_quick("fault_isolation.py", timeout_s=600, inherit_env=True)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    bad = re.findall(r"^   (?:token id|bad stop|NaN|lone|nested)[^:]*: (\d+)$", out, re.MULTILINE)
    assert len(bad) == 5 and all(status.startswith("4") for status in bad), out
    assert "canary streams lost: 0 (must be 0)" in out and "its status: 200; canary streams lost: 0" in out
    assert re.search(r"worker pid unchanged: True", out) and "peers logged as lost or gone: 0" in out
    assert re.search(r"hostile requests: \d+, statuses \[(4\d\d(, )?)+\]", out), out
