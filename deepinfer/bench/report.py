"""A bench's reports in one folder: the JSON (every figure and per-request list), the Markdown
(tables and the plots), and the plots themselves (matplotlib, when it is installed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from deepinfer.bench.economics import DEVICE_TIME_NOTE

JSON_NAME, MARKDOWN_NAME = "report.json", "report.md"
PLOTS = {
    "throughput.png": "throughput against load",
    "ttft_cdf.png": "TTFT CDF",
    "itl_cdf.png": "ITL CDF",
}
NO_MATPLOTLIB = "matplotlib is not installed (pip install 'deepinfer[bench]'): no plots"
ECONOMICS_COLUMNS = ["load", "input (uncached)", "input (cached)", "output", "revenue"]
ECONOMICS_COLUMNS += ["revenue / device-h", "gross margin / device-h", "gross margin"]
LATENCY_COLUMNS = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2EL", "e2el"))


def write_reports(out: Path, report: dict[str, Any]) -> list[Path]:
    """report.json, report.md and the plots into ``out``; the paths written. Without matplotlib
    the bench says so on stderr and in the Markdown, and writes the rest."""
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(out, report["runs"], report["config"]["load_kind"])
    if plots is None:
        print(f"deepinfer bench: {NO_MATPLOTLIB}", file=sys.stderr)
    paths = [out / JSON_NAME, out / MARKDOWN_NAME, *(plots or [])]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    paths[1].write_text(markdown(report, plots is not None))
    return paths


def write_plots(out: Path, runs: list[dict[str, Any]], load_kind: str) -> list[Path] | None:
    """Throughput against the load levels, and the TTFT and ITL CDFs of each run; None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display wanted, none may exist
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    levels = [run[load_kind] for run in runs]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, name in (("output_throughput", "output"), ("total_token_throughput", "input + output")):
        ax.plot(levels, [run[key] for run in runs], marker="o", label=name)
    ax.set(xlabel=load_kind.replace("_", " "), ylabel="tokens/s", title="Throughput")
    ax.set_xticks(levels)
    ax.legend()
    ax.grid(alpha=0.3)
    paths = [save(fig, out / "throughput.png")]
    for name, metric in (("ttft_cdf.png", "TTFT"), ("itl_cdf.png", "ITL")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for run in runs:
            ordered = sorted(1000.0 * v for v in samples_s(run, metric))
            ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=run["load"])
        unit = "requests" if metric == "TTFT" else "gaps between token events"
        ax.set(xlabel=f"{metric} (ms)", ylabel=f"fraction of {unit}", title=f"{metric} CDF", ylim=(0, 1.02))
        ax.legend()
        ax.grid(alpha=0.3)
        paths.append(save(fig, out / name))
    return paths


def samples_s(run: dict[str, Any], metric: str) -> list[float]:
    """A run's TTFTs (its completed requests') or ITLs (every gap of every request), in s."""
    if metric == "TTFT":
        return [t for t, error in zip(run["ttfts"], run["errors"], strict=True) if not error]
    return [gap for gaps in run["itls"] for gap in gaps]


def save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def money(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{'-' if value < 0 else ''}${abs(value):,.{digits}f}"


def markdown(report: dict[str, Any], with_plots: bool) -> str:
    config, runs, prices = report["config"], report["runs"], report["prices"]
    parts = [
        f"# deepinfer bench: {config['workload']} against {config['base_url']}\n",
        f"Model `{config['model']}`, {config['num_prompts']} requests per run, input {config['input_len']}"
        f" words, output {config['output_len']} tokens, ignore_eos {config['ignore_eos']}, seed"
        f" {config['seed']}, {config['started']}.\n",
        "## Throughput and latency\n",
        table(
            ["load", "completed", "failed", "duration s", "req/s", "output tok/s", "total tok/s"]
            + [f"{name} {stat} ms" for name, _ in LATENCY_COLUMNS for stat in ("mean", "p99")],
            [
                [run["load"], str(run["completed"]), str(run["failed"]), f"{run['duration']:.2f}"]
                + [
                    f"{run[k]:.2f}"
                    for k in ("request_throughput", "output_throughput", "total_token_throughput")
                ]
                + [f"{run[f'{stat}_{key}_ms']:.1f}" for _, key in LATENCY_COLUMNS for stat in ("mean", "p99")]
                for run in runs
            ],
        ),
        "## Economics\n",
        f"Prices per million tokens: input {money(prices['input_per_m'], 4)}, cache-hit input"
        f" {money(prices['cached_input_per_m'], 4)}, output {money(prices['output_per_m'], 4)}; rental"
        f" {money(prices['rental_per_device_hour'])} per device-hour, {prices['num_devices']} device(s)."
        f" {DEVICE_TIME_NOTE} Cached input tokens are the server's"
        " `usage.prompt_tokens_details.cached_tokens` (none where it does not report them).\n",
        table(ECONOMICS_COLUMNS, [economics_row(run) for run in runs]),
    ]
    if with_plots:
        parts += ["## Plots\n"] + [f"![{title}]({name})\n" for name, title in PLOTS.items()]
    else:
        parts.append(f"## Plots\n\n{NO_MATPLOTLIB}.\n")
    errors = [(run["load"], e) for run in runs for e in dict.fromkeys(run["errors"]) if e]
    if errors:
        parts += ["## Errors\n"] + [f"- {load}: {e}" for load, e in errors[:20]] + [""]
    return "\n".join(parts)


def economics_row(run: dict[str, Any]) -> list[str]:
    e = run["economics"]
    pct = e["gross_margin_pct"]
    return [
        run["load"],
        str(e["uncached_input_tokens"]),
        str(e["cached_input_tokens"]),
        str(e["output_tokens"]),
        money(e["revenue_usd"], 6),
        money(e["revenue_per_device_hour"], 4),
        money(e["gross_margin_per_device_hour"], 4),
        "-" if pct is None else f"{pct:.1f}%",
    ]
