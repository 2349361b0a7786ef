"""``deepinfer bench --quick`` as a subprocess against the running stack: it exits 0 and its reports
hold together (every request completed, the totals are the sums of the usages, the throughputs
are the totals over the duration, the economics follow from the totals), with the Markdown and
the plots beside the JSON."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from deepinfer.bench.economics import Prices, economics
from deepinfer.bench.report import PLOTS
from tests.system.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_TOKENS = 64  # at most what SmolLM2's chat template adds around a user message


def bench(stack: Stack, out: Path, *flags: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "deepinfer", "bench", "--base-url", stack.base_url, "--out", str(out)]
    proc = subprocess.run(
        [*argv, "--quick", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reports: " in proc.stdout
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


def test_quick_synthetic_report_is_consistent(stack: Stack, tmp_path: Path) -> None:
    report = bench(stack, tmp_path)
    listed = httpx.get(f"{stack.base_url}/models").json()["data"]
    assert report["config"]["model"] == listed[0]["id"]  # no --model: the first the server lists
    assert [r["max_concurrency"] for r in report["runs"]] == [1, 4]
    for run in report["runs"]:
        assert (run["completed"], run["failed"], run["usage_reported"]) == (8, 0, 8)
        assert run["output_lens"] == [8] * 8  # ignore_eos: exactly --output-len each
        assert run["total_output_tokens"] == sum(run["output_lens"])
        assert run["total_input_tokens"] == sum(run["input_lens"])
        assert all(32 <= n <= 32 + TEMPLATE_TOKENS for n in run["input_lens"])
        duration = run["duration"]
        assert duration >= max(run["latencies"]) > 0
        assert run["request_throughput"] == pytest.approx(8 / duration)
        assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / duration)
        total = run["total_input_tokens"] + run["total_output_tokens"]
        assert run["total_token_throughput"] == pytest.approx(total / duration)
        assert len(run["itls"]) == 8 and all(len(gaps) >= 1 for gaps in run["itls"])
        assert 0 < run["median_ttft_ms"] <= run["p99_ttft_ms"] <= run["p99_e2el_ms"]
        assert run["mean_e2el_ms"] > run["mean_ttft_ms"] and run["mean_tpot_ms"] > 0
        assert run["economics"] == pytest.approx(economics(run, Prices()))
        assert run["economics"]["revenue_usd"] > 0
    assert all((tmp_path / name).stat().st_size > 0 for name in PLOTS)
    markdown = (tmp_path / "report.md").read_text()
    assert "| concurrency 4 | 8 | 0 |" in markdown and "wall time" in markdown


def test_quick_agent_conversations_hit_the_prefix_cache(stack: Stack, tmp_path: Path) -> None:
    report = bench(
        stack, tmp_path, "--workload", "agent", "--turns", "4", "--concurrency", "2", "--seed", "5"
    )
    (run,) = report["runs"]
    assert (run["completed"], run["failed"]) == (8, 0)
    # two conversations of four turns, in order: each turn's prompt holds the one before and its reply
    for conversation in (run["input_lens"][:4], run["input_lens"][4:]):
        assert all(b >= a + 8 + 32 for a, b in itertools.pairwise(conversation))
    later_turns = run["cached_lens"][1:4] + run["cached_lens"][5:]
    assert all(n > 0 for n in later_turns), run["cached_lens"]
    assert run["total_cached_input_tokens"] == sum(run["cached_lens"])
    assert run["economics"]["cached_input_tokens"] == run["total_cached_input_tokens"]
