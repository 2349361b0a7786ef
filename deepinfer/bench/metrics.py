"""A run's figures from its requests' outcomes, named and computed as ``vllm bench serve`` does.

Over the completed requests (no error): TTFT is send to the first token event (a delta carrying
content or reasoning); TPOT is (E2EL - TTFT) / (output tokens - 1) for requests of more than one
token; ITL is every gap between consecutive token events of every request; E2EL is send to the
stream's end. Each gets mean, median, std (population) and p99 (linear interpolation) in ms, 0
where there is nothing to measure.
Throughputs divide by the run's wall time, ``duration``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from deepinfer.bench.client import StreamOutcome

PERCENTILES = (99,)
LATENCIES = ("ttft", "tpot", "itl", "e2el")


def stats_ms(name: str, values_s: Sequence[float]) -> dict[str, float]:
    """mean / median / std / p99 of ``values_s`` in ms, keyed ``{stat}_{name}_ms``."""
    values = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    out = {
        f"mean_{name}_ms": float(np.mean(values)),
        f"median_{name}_ms": float(np.median(values)),
        f"std_{name}_ms": float(np.std(values)),
    }
    out.update({f"p{p}_{name}_ms": float(np.percentile(values, p)) for p in PERCENTILES})
    return out


def tpot_s(outcome: StreamOutcome) -> float | None:
    if outcome.num_tokens <= 1 or outcome.ttft_s is None:
        return None
    return (outcome.latency_s - outcome.ttft_s) / (outcome.num_tokens - 1)


def summarize(outcomes: Sequence[StreamOutcome], duration_s: float) -> dict[str, Any]:
    """The run's metrics (``vllm bench serve``'s keys), the cached prompt tokens the server
    reported, how many completed requests had a usage chunk, and the per-request lists the plots
    are drawn from, in ``outcomes``' order."""
    done = [o for o in outcomes if o.error is None]
    total_input = sum(o.prompt_tokens for o in done)
    total_output = sum(o.num_tokens for o in done)
    per_second = 1.0 / duration_s if duration_s > 0 else 0.0
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "total_cached_input_tokens": sum(o.cached_tokens for o in done),
        "request_throughput": len(done) * per_second,
        "output_throughput": total_output * per_second,
        "total_token_throughput": (total_input + total_output) * per_second,
    }
    tpots = [t for t in map(tpot_s, done) if t is not None]
    result.update(stats_ms("ttft", [o.ttft_s for o in done if o.ttft_s is not None]))
    result.update(stats_ms("tpot", tpots))
    result.update(stats_ms("itl", [gap for o in done for gap in o.itls_s]))
    result.update(stats_ms("e2el", [o.latency_s for o in done]))
    kept = [o if o.error is None else None for o in outcomes]  # a failed request: 0s and []
    result |= {
        "input_lens": [o.prompt_tokens if o else 0 for o in kept],
        "output_lens": [o.num_tokens if o else 0 for o in kept],
        "cached_lens": [o.cached_tokens if o else 0 for o in kept],
        "ttfts": [(o.ttft_s or 0.0) if o else 0.0 for o in kept],
        "itls": [list(o.itls_s) if o else [] for o in kept],
        "latencies": [o.latency_s if o else 0.0 for o in kept],
        "errors": [o.error or "" for o in outcomes],
        "usage_reported": sum(o.usage is not None for o in done),
    }
    return result
