"""The KV cache at the gateway, over HTTP in-process on the in-memory bus: each API's submit carries
the tenant of the client's key and the retention class it asked for, an unknown class is a 400 in
the API's own error shape, cached prompt tokens reach every API's usage (streamed or not), and
/metrics shows what the services publish. The tenant also owns what outlives a request: only the
key that started a stream resumes it, and only the key that created a stored response reads,
continues or cancels it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from libs.bus.memory import InMemoryBus
from libs.kvstore.retention import RetentionPolicy, parse_retention_classes
from libs.protocol.codec import encode
from libs.protocol.kv_messages import KVCacheStats, TierCounter
from services.gateway.app import build_app
from services.gateway.cache_scope import CACHE_CLASS_HEADER, CacheScoping, tenant_of_key
from services.gateway.response_store import ResponseStore
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService
from tests.service.test_gateway_app import BODY, MODEL, SUBJECTS, FakeScheduler

# scratch is evicted first (in_memory reads as it), agent is the default (24h reads as it).
POLICY = RetentionPolicy(parse_retention_classes("agent=3d:1,scratch=1h:0,chat=7d:2"), "agent")
PROMPT = "Tell me something about the sea, the sky and the long road home."
USER = [{"role": "user", "content": PROMPT}]
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {**BODY, "max_tokens": 40}),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 40}),
    "responses": ("/v1/responses", {"model": MODEL, "input": PROMPT, "store": False}),
    "messages": ("/v1/messages", {"model": MODEL, "max_tokens": 40, "messages": USER}),
}
OPENAI_APIS = ("chat", "completions", "responses")
CACHED = 3


@pytest.fixture(scope="module")
def served(model_cache_dir: Path) -> ServedModel:
    return ServedModel.load("smollm2", str(model_cache_dir), "", 0)


@pytest.fixture
def gateway(served: ServedModel) -> Iterator[tuple[TestClient, FakeScheduler, InMemoryBus]]:
    bus = InMemoryBus()
    service = GatewayService(bus, SUBJECTS, "gw1", submit_timeout_s=1)
    store = ResponseStore(bus, SUBJECTS.responses_bucket, 60)
    fake = FakeScheduler(bus, served)
    fake.cached = CACHED

    async def startup() -> None:
        await service.start()
        await store.start()
        await fake.start()

    with TestClient(build_app(service, served, store, scoping=CacheScoping(POLICY))) as client:
        assert client.portal is not None
        client.portal.call(startup)
        yield client, fake, bus


def key_header(api: str, key: str) -> dict[str, str]:
    return {"x-api-key": key} if api == "messages" else {"authorization": f"Bearer {key}"}


@pytest.mark.parametrize("api", list(REQUESTS))
def test_each_api_submits_its_keys_tenant_and_its_class(
    gateway: tuple[TestClient, FakeScheduler, InMemoryBus], api: str
) -> None:
    client, fake, _ = gateway
    path, body = REQUESTS[api]
    for headers in (
        key_header(api, "k1"),
        {**key_header(api, "k1"), CACHE_CLASS_HEADER: "Chat"},
        key_header(api, "k2"),
        {},
    ):
        resp = client.post(path, json=body, headers=headers)
        assert resp.status_code == 200, resp.text
    first, same_key, other_key, no_key = fake.submitted
    assert first.tenant == same_key.tenant == tenant_of_key("k1") != ""
    assert other_key.tenant not in ("", first.tenant) and no_key.tenant == ""
    assert [s.retention_class for s in fake.submitted] == ["agent", "chat", "agent", "agent"]


@pytest.mark.parametrize("api", OPENAI_APIS)
def test_openai_apis_read_prompt_cache_retention(
    gateway: tuple[TestClient, FakeScheduler, InMemoryBus], api: str
) -> None:
    client, fake, _ = gateway
    path, body = REQUESTS[api]
    for value in ("chat", "in_memory", "24h"):
        resp = client.post(path, json={**body, "prompt_cache_retention": value, "prompt_cache_key": "p"})
        assert resp.status_code == 200, resp.text
    resp = client.post(
        path, json={**body, "prompt_cache_retention": "in_memory"}, headers={CACHE_CLASS_HEADER: "chat"}
    )
    assert resp.status_code == 200
    assert [s.retention_class for s in fake.submitted] == ["chat", "scratch", "agent", "chat"]


@pytest.mark.parametrize(
    ("api", "patch", "headers", "param"),
    [
        ("chat", {"prompt_cache_retention": "forever"}, {}, "prompt_cache_retention"),
        ("completions", {"prompt_cache_retention": "forever"}, {}, "prompt_cache_retention"),
        ("responses", {}, {CACHE_CLASS_HEADER: "forever"}, CACHE_CLASS_HEADER),
        ("messages", {}, {CACHE_CLASS_HEADER: "forever"}, CACHE_CLASS_HEADER),
        ("chat", {"prompt_cache_retention": 24}, {}, "prompt_cache_retention"),
        ("responses", {"prompt_cache_key": "k" * 257}, {}, "prompt_cache_key"),
    ],
)
def test_a_bad_class_is_a_400_in_the_apis_shape_and_the_next_request_is_served(
    gateway: tuple[TestClient, FakeScheduler, InMemoryBus],
    api: str,
    patch: dict[str, Any],
    headers: dict[str, str],
    param: str,
) -> None:
    client, fake, _ = gateway
    path, body = REQUESTS[api]
    resp = client.post(path, json={**body, **patch}, headers=headers)
    assert resp.status_code == 400
    if api == "messages":
        error = resp.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        message = error["error"]["message"]
    else:
        assert resp.json()["error"]["param"] == param
        message = resp.json()["error"]["message"]
    assert param in message
    if "forever" in json.dumps([patch, headers]):
        assert all(f"'{name}'" in message for name in ("agent", "scratch", "chat"))
    assert fake.submitted == []
    assert client.post(path, json=body).status_code == 200  # still serving


def sse_data(text: str) -> list[dict[str, Any]]:
    lines = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def cached_in_body(api: str, body: dict[str, Any]) -> int:
    usage = body["usage"]
    if api == "responses":
        return int(usage["input_tokens_details"]["cached_tokens"])
    if api == "messages":
        return int(usage["cache_read_input_tokens"])
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def cached_in_stream(api: str, events: list[dict[str, Any]]) -> list[int]:
    """Every place the stream reports cached prompt tokens."""
    if api == "responses":
        [done] = [e for e in events if e["type"] == "response.completed"]
        return [cached_in_body(api, done["response"])]
    if api == "messages":
        [start] = [e for e in events if e["type"] == "message_start"]
        [delta] = [e for e in events if e["type"] == "message_delta"]
        return [cached_in_body(api, start["message"]), cached_in_body(api, delta)]
    return [cached_in_body(api, events[-1])]  # the usage chunk


@pytest.mark.parametrize("api", list(REQUESTS))
def test_cached_prompt_tokens_reach_every_apis_usage(
    gateway: tuple[TestClient, FakeScheduler, InMemoryBus], api: str
) -> None:
    client, _, _ = gateway
    path, body = REQUESTS[api]
    whole = client.post(path, json=body).json()
    assert cached_in_body(api, whole) == CACHED
    if api == "messages":  # Anthropic's split: input_tokens are the uncached ones
        assert whole["usage"]["input_tokens"] > 0
    stream_body = {**body, "stream": True}
    if api in ("chat", "completions"):
        stream_body["stream_options"] = {"include_usage": True}
    events = sse_data(client.post(path, json=stream_body).text)
    assert cached_in_stream(api, events) == [CACHED] * len(cached_in_stream(api, events))


def test_metrics_show_the_published_stats_and_the_hit_rate(
    gateway: tuple[TestClient, FakeScheduler, InMemoryBus],
) -> None:
    client, _, bus = gateway
    published = [
        KVCacheStats(
            "s1", "scheduler", (TierCounter("hit_tokens", "G1", 30), TierCounter("query_tokens", "all", 100))
        ),
        KVCacheStats(
            "s2", "scheduler", (TierCounter("hit_tokens", "G3", 10), TierCounter("query_tokens", "", 100))
        ),
        KVCacheStats("kv1", "kvcache", (TierCounter("stored_blocks", "chat", 7),)),
    ]

    async def publish() -> None:
        for stats in published:
            await bus.publish(SUBJECTS.stats(stats.kind, stats.publisher_id), encode(stats))
        for _ in range(10):  # let the gateway's subscription take them in
            await asyncio.sleep(0)

    assert client.portal is not None
    client.portal.call(publish)
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }
    assert (
        samples[("deepinfer_kv_hit_tokens", (("kind", "scheduler"), ("label", "G1"), ("publisher", "s1")))]
        == 30
    )
    assert (
        samples[
            ("deepinfer_kv_stored_blocks", (("kind", "kvcache"), ("label", "chat"), ("publisher", "kv1")))
        ]
        == 7
    )
    assert samples[("deepinfer_kv_hit_rate", (("tier", "G1"),))] == pytest.approx(0.15)
    assert samples[("deepinfer_kv_hit_rate", (("tier", "G3"),))] == pytest.approx(0.05)
    assert samples[("deepinfer_gateway_requests_in_flight", (("gateway", "gw1"),))] == 0


def sse_events(text: str) -> list[tuple[int, str]]:
    """(id, data) of each SSE event."""
    events, event_id = [], -1
    for line in text.splitlines():
        if line.startswith("id: "):
            event_id = int(line[len("id: ") :])
        elif line.startswith("data: "):
            events.append((event_id, line[len("data: ") :]))
    return events


@pytest.mark.parametrize("api", ["chat", "completions", "messages"])
def test_only_the_same_key_resumes_a_stream(
    gateway: tuple[TestClient, FakeScheduler, InMemoryBus], api: str
) -> None:
    client, fake, _ = gateway
    path, body = REQUESTS[api]
    with client.stream("POST", path, json={**body, "stream": True}, headers=key_header(api, "key-a")) as resp:
        assert resp.status_code == 200
        live = sse_events("".join(resp.iter_text()))
    url = f"{path}/{fake.submitted[-1].request_id}?stream=true"

    other = client.get(url, headers={**key_header(api, "key-b"), "last-event-id": "1"})
    assert other.status_code == 404
    assert "no resumable stream" in json.dumps(other.json()["error"])
    anonymous = client.get(url, headers={"last-event-id": "1"})
    assert anonymous.status_code == 404

    own = client.get(url, headers={**key_header(api, "key-a"), "last-event-id": "1"})
    assert own.status_code == 200
    assert sse_events(own.text) == [(i, data) for i, data in live if i > 1]


def test_a_stored_response_is_its_tenants_only(
    gateway: tuple[TestClient, FakeScheduler, InMemoryBus],
) -> None:
    client, _, _ = gateway
    mine, theirs = key_header("responses", "key-a"), key_header("responses", "key-b")
    response_id = client.post("/v1/responses", json={"model": MODEL, "input": PROMPT}, headers=mine).json()[
        "id"
    ]

    assert client.get(f"/v1/responses/{response_id}", headers=theirs).status_code == 404
    assert client.post(f"/v1/responses/{response_id}/cancel", headers=theirs).status_code == 404
    follow_up = {"model": MODEL, "input": "And then?", "previous_response_id": response_id, "store": False}
    refused = client.post("/v1/responses", json=follow_up, headers=theirs)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"

    assert client.get(f"/v1/responses/{response_id}", headers=mine).json()["id"] == response_id
    assert client.post("/v1/responses", json=follow_up, headers=mine).status_code == 200
