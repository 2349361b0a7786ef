"""deepinfer bench's command line and reports: the flags as a plan (--quick's defaults, load lists,
prices), the light ``deepinfer --help``, and the report folder with and without matplotlib."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from deepinfer import bench
from deepinfer.bench.client import StreamOutcome
from deepinfer.bench.economics import Prices, economics
from deepinfer.bench.loadgen import Load
from deepinfer.bench.metrics import summarize
from deepinfer.bench.report import JSON_NAME, MARKDOWN_NAME, NO_MATPLOTLIB, PLOTS, write_reports
from deepinfer.bench.run import plan

ROOT = Path(__file__).resolve().parents[3]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_args(parser)
    return parser.parse_args(["--base-url", "http://server/v1", *argv])


def test_quick_fills_in_what_was_not_given() -> None:
    quick = plan(parse("--quick"))
    assert quick.loads == (Load(concurrency=1), Load(concurrency=4)) and quick.num_prompts == 8
    assert (str(quick.inputs), str(quick.outputs)) == ("32", "8")
    mine = plan(parse("--quick", "--request-rate", "0.5,2", "--num-prompts", "3", "--output-len", "4:9"))
    assert mine.loads == (Load(request_rate=0.5), Load(request_rate=2.0)) and mine.num_prompts == 3
    assert str(mine.outputs) == "uniform 4:9"


def test_prices_follow_the_flags() -> None:
    assert plan(parse("--concurrency", "2")).prices == Prices()
    p = plan(parse("--concurrency", "2", "--price-input-per-m", "1.0", "--num-devices", "8")).prices
    assert p.cached_input_per_m == pytest.approx(0.02) and p.num_devices == 8
    assert (
        plan(parse("--concurrency", "2", "--price-cached-input-per-m", "0.1")).prices.cached_input_per_m
        == 0.1
    )


def test_a_load_is_required_and_one_kind_only() -> None:
    with pytest.raises(ValueError, match="--concurrency or --request-rate"):
        plan(parse())
    with pytest.raises(SystemExit):
        parse("--concurrency", "1", "--request-rate", "1")
    for bad in (("--concurrency", "0"), ("--concurrency", "1.5"), ("--request-rate", "x")):
        with pytest.raises(ValueError):
            plan(parse(*bad))
    with pytest.raises(ValueError, match="--num-prompts"):
        plan(parse("--concurrency", "1", "--num-prompts", "0"))


def test_the_command_line_stays_light() -> None:
    code = (
        "import sys, deepinfer.cli; deepinfer.cli.build_parser(); "
        "print(sorted(m for m in ('deepinfer.bench.run', 'httpx', 'tqdm', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def report() -> dict[str, Any]:
    done = StreamOutcome(
        3, 0.1, None, {"prompt_tokens": 7, "completion_tokens": 3}, 0.0, (0.1, 0.2, 0.3), 0.3
    )
    runs = []
    for n in (1, 2):
        run: dict[str, Any] = {"load": f"concurrency {n}", "max_concurrency": n, "request_rate": None}
        run |= summarize([done, StreamOutcome(0, None, "HTTP 429: busy")], 0.5)
        run["economics"] = economics(run, Prices())
        runs.append(run)
    config = {"base_url": "http://server/v1", "model": "m", "workload": "synthetic", "num_prompts": 2}
    config |= {"input_len": "7", "output_len": "3", "ignore_eos": True, "seed": 0}
    config |= {"load_kind": "max_concurrency", "started": "now"}
    return {"config": config, "prices": Prices().as_dict(), "runs": runs}


def test_the_reports_are_written(tmp_path: Path) -> None:
    paths = write_reports(tmp_path / "out", report())
    assert {p.name for p in paths} == {JSON_NAME, MARKDOWN_NAME, *PLOTS}
    assert all(p.stat().st_size > 0 for p in paths)
    assert all((tmp_path / "out" / name).read_bytes()[:4] == b"\x89PNG" for name in PLOTS)
    data = json.loads((tmp_path / "out" / JSON_NAME).read_text())
    assert [r["completed"] for r in data["runs"]] == [1, 1]
    text = (tmp_path / "out" / MARKDOWN_NAME).read_text()
    assert "| concurrency 2 | 1 | 1 |" in text and "HTTP 429: busy" in text
    assert "wall time" in text and "![TTFT CDF](ttft_cdf.png)" in text
    assert "| -$6.9768 |" in text  # the rental dwarfs 10 tokens' revenue: a negative margin, signed


def test_without_matplotlib_the_rest_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` sees when absent
    paths = write_reports(tmp_path, report())
    assert [p.name for p in paths] == [JSON_NAME, MARKDOWN_NAME]
    assert not list(tmp_path.glob("*.png"))
    assert NO_MATPLOTLIB in (tmp_path / MARKDOWN_NAME).read_text()
    assert NO_MATPLOTLIB in capsys.readouterr().err
