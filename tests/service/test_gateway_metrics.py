"""The gateway's /metrics after real requests through the app (in-memory bus, the scripted
scheduler of test_gateway_app): requests by api and outcome, TTFT / ITL / e2e observed, token
counters equal to the usage the responses reported. Read back with prometheus_client's parser."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from libs.protocol.messages import SubmitStatus
from tests.service import test_gateway_app as app_tests
from tests.service.test_gateway_app import BODY, MODEL, Make, sse_chunks

served = app_tests.served  # the fixtures of the app tests, here too
client_with = app_tests.client_with

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(client: TestClient) -> Samples:
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_requests_are_counted_timed_and_their_tokens_summed(client_with: Make) -> None:
    client, fake = client_with("run")
    fake.cached = 2
    whole = client.post("/v1/chat/completions", json={**BODY, "max_tokens": 40})
    assert whole.status_code == 200
    body = {**BODY, "max_tokens": 40, "stream": True, "stream_options": {"include_usage": True}}
    streamed = sse_chunks(client.post("/v1/chat/completions", json=body).text)
    usages = [whole.json()["usage"], streamed[-1]["usage"]]
    samples = scrape(client)

    assert value(samples, "deepinfer_requests_total", api="chat", outcome="ok") == 2
    assert value(samples, "deepinfer_requests_in_flight", api="chat") == 0
    num_steps = math.ceil(len(fake.choice_ids(0)) / 2)  # the fake sends two tokens per step
    for name, count in (
        ("deepinfer_time_to_first_token_seconds", 2),
        ("deepinfer_inter_token_latency_seconds", 2 * (num_steps - 1)),  # one per later delta
        ("deepinfer_e2e_request_latency_seconds", 2),
    ):
        assert value(samples, name + "_count", api="chat") == count, name
        assert value(samples, name + "_bucket", api="chat", le="+Inf") == count, name
        assert value(samples, name + "_sum", api="chat") > 0, name
    ttft = value(samples, "deepinfer_time_to_first_token_seconds_sum", api="chat")
    assert ttft < value(samples, "deepinfer_e2e_request_latency_seconds_sum", api="chat")

    assert value(samples, "deepinfer_prompt_tokens_total", api="chat") == sum(
        u["prompt_tokens"] for u in usages
    )
    assert value(samples, "deepinfer_generation_tokens_total", api="chat") == sum(
        u["completion_tokens"] for u in usages
    )
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached == 4 and value(samples, "deepinfer_cached_prompt_tokens_total", api="chat") == cached


def test_rejections_are_counted_by_outcome_and_not_timed(client_with: Make) -> None:
    client, _ = client_with("run")
    assert client.post("/v1/chat/completions", json={**BODY, "n": 17}).status_code == 400
    bad = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}  # no max_tokens
    assert client.post("/v1/messages", json=bad).status_code == 400
    assert (
        client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code
        == 200
    )
    assert client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": "x"}).status_code == 400
    samples = scrape(client)
    assert value(samples, "deepinfer_requests_total", api="chat", outcome="client_error") == 1
    assert value(samples, "deepinfer_requests_total", api="messages", outcome="client_error") == 1
    assert value(samples, "deepinfer_requests_total", api="completions", outcome="ok") == 1
    requests = sum(v for (name, _), v in samples.items() if name == "deepinfer_requests_total")
    assert requests == 3  # count_tokens generates nothing: not a request
    assert value(samples, "deepinfer_time_to_first_token_seconds_count", api="chat") == 0
    assert value(samples, "deepinfer_e2e_request_latency_seconds_count", api="chat") == 0
    assert value(samples, "deepinfer_time_to_first_token_seconds_count", api="completions") == 1

    full, _ = client_with(SubmitStatus.QUEUE_FULL)
    assert full.post("/v1/chat/completions", json=BODY).status_code == 429
    assert full.post("/v1/chat/completions", json=BODY).status_code == 429
    samples = scrape(full)
    assert value(samples, "deepinfer_requests_total", api="chat", outcome="queue_full") == 2
    assert value(samples, "deepinfer_requests_in_flight", api="chat") == 0


def test_the_kv_stats_and_pending_gauge_stay_on_the_same_page(client_with: Make) -> None:
    client, _ = client_with("run")
    samples = scrape(client)
    assert value(samples, "deepinfer_gateway_requests_in_flight", gateway="gw1") == 0
    assert any(name.startswith("process_") for name, _ in samples)
