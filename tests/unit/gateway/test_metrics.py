"""The gateway's KV-cache metrics, pure: every publisher's counters, the schedulers' hit rate per
tier, stale publishers dropped; and what prometheus_client makes of them (parsed back, families
together, escaped labels, numbers). Also how a request's outcome is named."""

from __future__ import annotations

import asyncio
import math

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from starlette.requests import ClientDisconnect

from libs.protocol.kv_messages import KVCacheStats, TierCounter
from services.gateway.fleet_metrics import StatsBoard, hit_rates, kv_families, metric_name
from services.gateway.metrics import outcome


def stats(kind: str, publisher: str, *counters: tuple[str, str, float]) -> KVCacheStats:
    return KVCacheStats(publisher, kind, tuple(TierCounter(*c) for c in counters))


S1 = stats(
    "scheduler", "s1", ("hit_tokens", "G1", 30), ("hit_tokens", "G3", 10), ("query_tokens", "all", 100)
)
S2 = stats("scheduler", "s2", ("hit_tokens", "G1", 10), ("query_tokens", "", 100))
W1 = stats("worker", "w1", ("loaded_blocks", "G2", 4), ("failed_loads", "corrupt", 1))


class Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def scraped(families: list[Metric]) -> list[tuple[str, str, list[tuple[dict[str, str], float]]]]:
    """The families as a scraper reads them from prometheus_client's text: (name, type, samples)."""
    registry = CollectorRegistry()
    registry.register(Fixed(families))
    text = generate_latest(registry).decode()
    return [
        (f.name, f.type, [(s.labels, s.value) for s in f.samples])
        for f in text_string_to_metric_families(text)
    ]


def test_counters_and_hit_rates_are_exposed_under_their_names() -> None:
    assert scraped(kv_families([S1, S2, W1])) == [
        (
            "deepinfer_kv_hit_tokens",
            "unknown",
            [
                ({"kind": "scheduler", "publisher": "s1", "label": "G1"}, 30),
                ({"kind": "scheduler", "publisher": "s1", "label": "G3"}, 10),
                ({"kind": "scheduler", "publisher": "s2", "label": "G1"}, 10),
            ],
        ),
        (
            "deepinfer_kv_query_tokens",
            "unknown",
            [
                ({"kind": "scheduler", "publisher": "s1", "label": "all"}, 100),
                ({"kind": "scheduler", "publisher": "s2", "label": ""}, 100),
            ],
        ),
        (
            "deepinfer_kv_loaded_blocks",
            "unknown",
            [({"kind": "worker", "publisher": "w1", "label": "G2"}, 4)],
        ),
        (
            "deepinfer_kv_failed_loads",
            "unknown",
            [({"kind": "worker", "publisher": "w1", "label": "corrupt"}, 1)],
        ),
        ("deepinfer_kv_hit_rate", "gauge", [({"tier": "G1"}, 0.2), ({"tier": "G3"}, 0.05)]),
    ]


def test_hit_rates_use_per_tier_query_tokens_where_a_scheduler_counts_them() -> None:
    per_tier = stats(
        "scheduler", "s3", ("hit_tokens", "G2", 5), ("query_tokens", "G2", 50), ("query_tokens", "", 1000)
    )
    assert hit_rates([per_tier]) == {"G2": 0.1}
    total = stats("scheduler", "s4", ("hit_tokens", "G1", 5), ("query_tokens", "total", 20))
    assert hit_rates([total]) == {"G1": 0.25}
    assert hit_rates([W1]) == {}  # only schedulers count queries
    assert hit_rates([stats("scheduler", "idle", ("hit_tokens", "G1", 0))]) == {}  # no queries: no rate
    assert [f.name for f in kv_families([W1])] == ["deepinfer_kv_loaded_blocks", "deepinfer_kv_failed_loads"]


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


def test_odd_labels_names_and_numbers_survive_the_round_trip() -> None:
    odd = stats("kvcache", 'kv"1\\', ("stored bytes/class", "line\nbreak", 1.5), ("x", "", float("inf")))
    labels = {"kind": "kvcache", "publisher": 'kv"1\\'}
    assert scraped(kv_families([odd])) == [
        ("deepinfer_kv_stored_bytes_class", "unknown", [({**labels, "label": "line\nbreak"}, 1.5)]),
        ("deepinfer_kv_x", "unknown", [({**labels, "label": ""}, math.inf)]),
    ]
    assert metric_name("") == "_"
    twice = stats("worker", "w", ("m", "", float("nan")), ("m", "", 3e20))  # the last one stays
    assert scraped(kv_families([twice])) == [
        ("deepinfer_kv_m", "unknown", [({"kind": "worker", "publisher": "w", "label": ""}, 3e20)])
    ]
    assert scraped(kv_families([])) == []


def test_outcomes_name_what_happened_to_a_request() -> None:
    assert outcome(200, None, error=False, abandoned=False) == "ok"
    assert outcome(200, None, error=True, abandoned=False) == "server_error"  # an error event ended it
    assert outcome(200, None, error=False, abandoned=True) == "cancelled"  # the SSE client left
    assert outcome(499, None, error=False, abandoned=True) == "cancelled"
    assert outcome(0, asyncio.CancelledError(), error=False, abandoned=False) == "cancelled"
    assert outcome(200, ClientDisconnect(), error=False, abandoned=True) == "cancelled"
    assert outcome(0, RuntimeError("bug"), error=False, abandoned=False) == "server_error"
    assert [outcome(s, None, False, False) for s in (400, 404, 413, 429, 503, 500)] == [
        "client_error",
        "client_error",
        "client_error",
        "queue_full",
        "unavailable",
        "server_error",
    ]
