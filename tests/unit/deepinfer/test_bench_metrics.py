"""deepinfer bench's metric math against values worked out by hand, with vllm bench serve's names."""

from __future__ import annotations

import math

import pytest

from deepinfer.bench.client import StreamOutcome
from deepinfer.bench.metrics import summarize


def outcome(
    start: float, times: tuple[float, ...], end: float, tokens: int, prompt: int, cached: int = 0
) -> StreamOutcome:
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return StreamOutcome(tokens, times[0] - start, None, usage, start, times, end, "x" * len(times))


# Two completed requests and one failed one, over a 4 s run:
#   a: sent at 0, content at 1, 2, 4, ends at 4: TTFT 1, ITL 1 and 2, E2EL 4, 3 tokens: TPOT 1.5
#   b: sent at 1, content at 1.5 and 2, ends at 2.5, 5 tokens (2 events): TTFT 0.5, ITL 0.5,
#      E2EL 1.5, TPOT (1.5 - 0.5) / 4 = 0.25
A = outcome(0.0, (1.0, 2.0, 4.0), 4.0, 3, 10, cached=4)
B = outcome(1.0, (1.5, 2.0), 2.5, 5, 20)
FAILED = StreamOutcome(0, None, "HTTP 500: boom", None, 0.0, (), 0.1)


def test_totals_and_throughputs_count_completed_requests_only() -> None:
    m = summarize([A, FAILED, B], 4.0)
    assert (m["completed"], m["failed"], m["duration"]) == (2, 1, 4.0)
    assert (m["total_input_tokens"], m["total_output_tokens"], m["total_cached_input_tokens"]) == (30, 8, 4)
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(2.0)
    assert m["total_token_throughput"] == pytest.approx(38 / 4)


def test_latencies_in_ms() -> None:
    m = summarize([A, FAILED, B], 4.0)
    assert m["mean_ttft_ms"] == pytest.approx(750.0)
    assert m["median_ttft_ms"] == pytest.approx(750.0)
    assert m["std_ttft_ms"] == pytest.approx(250.0)  # population std, as numpy's default
    assert m["p99_ttft_ms"] == pytest.approx(500.0 + 0.99 * 500.0)  # linear interpolation
    assert m["mean_tpot_ms"] == pytest.approx((1500.0 + 250.0) / 2)
    # every gap of every request: 1, 2 and 0.5 s
    assert m["mean_itl_ms"] == pytest.approx(3500.0 / 3)
    assert m["median_itl_ms"] == pytest.approx(1000.0)
    assert m["std_itl_ms"] == pytest.approx(
        1000.0 * math.sqrt(((1 - 7 / 6) ** 2 + (2 - 7 / 6) ** 2 + (0.5 - 7 / 6) ** 2) / 3)
    )
    assert m["p99_itl_ms"] == pytest.approx(1000.0 + 0.98 * 1000.0)
    assert m["mean_e2el_ms"] == pytest.approx(2750.0)
    assert m["p99_e2el_ms"] == pytest.approx(1500.0 + 0.99 * 2500.0)


def test_the_keys_are_vllm_bench_serves() -> None:
    m = summarize([A], 1.0)
    for key in ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens"):
        assert key in m
    for key in ("request_throughput", "output_throughput", "total_token_throughput"):
        assert key in m
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert f"{stat}_{metric}_ms" in m


def test_per_request_lists_keep_the_order_and_zero_the_failed() -> None:
    m = summarize([A, FAILED, B], 4.0)
    assert m["output_lens"] == [3, 0, 5]
    assert m["input_lens"] == [10, 0, 20]
    assert m["cached_lens"] == [4, 0, 0]
    assert m["ttfts"] == pytest.approx([1.0, 0.0, 0.5])
    assert m["itls"][1] == []
    assert m["itls"][0] == pytest.approx([1.0, 2.0])
    assert m["errors"] == ["", "HTTP 500: boom", ""]
    assert sum(m["output_lens"]) == m["total_output_tokens"]


def test_a_one_token_request_has_no_tpot_and_nothing_measured_is_zero() -> None:
    one = outcome(0.0, (0.2,), 0.3, 1, 5)
    m = summarize([one], 1.0)
    assert m["mean_tpot_ms"] == 0.0 and m["mean_itl_ms"] == 0.0
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    empty = summarize([FAILED], 0.5)
    assert (empty["completed"], empty["failed"], empty["output_throughput"], empty["p99_e2el_ms"]) == (
        0,
        1,
        0,
        0,
    )


def test_without_usage_tokens_are_content_events_and_input_is_unknown() -> None:
    bare = StreamOutcome(2, 0.1, None, None, 0.0, (0.1, 0.2), 0.25, "ab")
    m = summarize([bare], 1.0)
    assert (m["total_output_tokens"], m["total_input_tokens"], m["usage_reported"]) == (2, 0, 0)
