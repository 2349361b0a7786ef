"""/metrics rendering, pure: every publisher's counters, the schedulers' hit rate per tier, stale
publishers dropped, and Prometheus' text format (families together, escaped labels, numbers)."""

from __future__ import annotations

from libs.protocol.kv_messages import KVCacheStats, TierCounter
from services.gateway.metrics import Sample, StatsBoard, hit_rates, kv_samples, metric_name, render


def stats(kind: str, publisher: str, *counters: tuple[str, str, float]) -> KVCacheStats:
    return KVCacheStats(publisher, kind, tuple(TierCounter(*c) for c in counters))


S1 = stats(
    "scheduler", "s1", ("hit_tokens", "G1", 30), ("hit_tokens", "G3", 10), ("query_tokens", "all", 100)
)
S2 = stats("scheduler", "s2", ("hit_tokens", "G1", 10), ("query_tokens", "", 100))
W1 = stats("worker", "w1", ("loaded_blocks", "G2", 4), ("failed_loads", "corrupt", 1))


def test_counters_and_hit_rates_render_as_prometheus_text() -> None:
    own = Sample("deepinfer_gateway_requests_in_flight", (("gateway", "gw1"),), 2)
    assert render([*kv_samples([S1, S2, W1]), own]) == (
        "# TYPE deepinfer_kv_hit_tokens untyped\n"
        'deepinfer_kv_hit_tokens{kind="scheduler",publisher="s1",label="G1"} 30\n'
        'deepinfer_kv_hit_tokens{kind="scheduler",publisher="s1",label="G3"} 10\n'
        'deepinfer_kv_hit_tokens{kind="scheduler",publisher="s2",label="G1"} 10\n'
        "# TYPE deepinfer_kv_query_tokens untyped\n"
        'deepinfer_kv_query_tokens{kind="scheduler",publisher="s1",label="all"} 100\n'
        'deepinfer_kv_query_tokens{kind="scheduler",publisher="s2",label=""} 100\n'
        "# TYPE deepinfer_kv_loaded_blocks untyped\n"
        'deepinfer_kv_loaded_blocks{kind="worker",publisher="w1",label="G2"} 4\n'
        "# TYPE deepinfer_kv_failed_loads untyped\n"
        'deepinfer_kv_failed_loads{kind="worker",publisher="w1",label="corrupt"} 1\n'
        "# TYPE deepinfer_kv_hit_rate gauge\n"
        'deepinfer_kv_hit_rate{tier="G1"} 0.2\n'
        'deepinfer_kv_hit_rate{tier="G3"} 0.05\n'
        "# TYPE deepinfer_gateway_requests_in_flight gauge\n"
        'deepinfer_gateway_requests_in_flight{gateway="gw1"} 2\n'
    )


def test_hit_rates_use_per_tier_query_tokens_where_a_scheduler_counts_them() -> None:
    per_tier = stats(
        "scheduler", "s3", ("hit_tokens", "G2", 5), ("query_tokens", "G2", 50), ("query_tokens", "", 1000)
    )
    assert hit_rates([per_tier]) == {"G2": 0.1}
    total = stats("scheduler", "s4", ("hit_tokens", "G1", 5), ("query_tokens", "total", 20))
    assert hit_rates([total]) == {"G1": 0.25}
    assert hit_rates([W1]) == {}  # only schedulers count queries
    assert hit_rates([stats("scheduler", "idle", ("hit_tokens", "G1", 0))]) == {}  # no queries: no rate


def test_the_board_keeps_the_latest_per_publisher_and_drops_the_silent() -> None:
    board = StatsBoard(stale_after_s=60)
    board.update(S2, now=0)
    board.update(W1, now=10)
    board.update(S1, now=20)
    newer = stats("scheduler", "s1", ("hit_tokens", "G1", 31))
    board.update(newer, now=30)
    assert board.current(now=40) == [newer, S2, W1]  # by kind, then publisher
    assert board.current(now=65) == [newer, W1]  # s2 silent for 65 s
    assert board.current(now=200) == []
    board.update(S2, now=201)  # back again: shown again
    assert board.current(now=202) == [S2]


def test_labels_are_escaped_names_sanitised_and_numbers_spelled_as_prometheus_reads_them() -> None:
    odd = stats("kvcache", 'kv"1\\', ("stored bytes/class", "line\nbreak", 1.5), ("x", "", float("inf")))
    assert render(kv_samples([odd])) == (
        "# TYPE deepinfer_kv_stored_bytes_class untyped\n"
        'deepinfer_kv_stored_bytes_class{kind="kvcache",publisher="kv\\"1\\\\",label="line\\nbreak"} 1.5\n'
        "# TYPE deepinfer_kv_x untyped\n"
        'deepinfer_kv_x{kind="kvcache",publisher="kv\\"1\\\\",label=""} +Inf\n'
    )
    assert metric_name("") == "_"
    assert render([Sample("m", (), float("nan")), Sample("m", (), 3e20)]) == "# TYPE m gauge\nm 3e+20\n"
    assert render([]) == ""
