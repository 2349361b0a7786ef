"""API keys in front of every /v1 route (in process: starlette TestClient, in-memory bus, the fake
scheduler of test_gateway_app): 401 in each API's shape, the key's tenant and priority on the
submit, rate limits with Retry-After and x-ratelimit-* headers, a reload, and per-tenant usage in
/metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from libs.bus.memory import InMemoryBus
from services.gateway.api_keys import hash_key
from services.gateway.app import build_app
from services.gateway.auth import KeyFile
from services.gateway.response_store import ResponseStore
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService
from tests.service.test_gateway_app import BODY, SUBJECTS, FakeScheduler

ACME, BETA, SLOW = "sk-di-acme", "sk-di-beta", "sk-di-slow"
MODEL = BODY["model"]
MESSAGES_BODY = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
POSTS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": BODY,
    "/v1/completions": {"model": MODEL, "prompt": "Hello", "max_tokens": 4},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 4},
    "/v1/messages": MESSAGES_BODY,
    "/v1/messages/count_tokens": {"model": MODEL, "messages": MESSAGES_BODY["messages"]},
}
GETS = (
    "/v1/models",
    "/v1/chat/completions/chatcmpl-x",
    "/v1/completions/cmpl-x",
    "/v1/messages/msg_x",
    "/v1/responses/resp_x",
    "/v1/no/such/route",
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write_keys(path: Path, *entries: dict[str, Any]) -> None:
    path.write_text(json.dumps({"keys": list(entries)}))


@pytest.fixture(scope="module")
def served(model_cache_dir: Path) -> ServedModel:
    return ServedModel.load("smollm2", str(model_cache_dir), "", 0)


class Harness:
    def __init__(self, client: TestClient, fake: FakeScheduler, keys: KeyFile, path: Path, clock: Clock):
        self.client, self.fake, self.keys, self.path, self.clock = client, fake, keys, path, clock

    def metric(self, name: str, **labels: str) -> float:
        text = self.client.get("/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0


@pytest.fixture
def harness(served: ServedModel, tmp_path: Path) -> Iterator[Harness]:
    path = tmp_path / "keys.json"
    write_keys(
        path,
        {"sha256": hash_key(ACME), "tenant": "acme", "priority": 2, "weight": 3},
        {"sha256": hash_key(BETA), "tenant": "beta"},
        {"sha256": hash_key(SLOW), "tenant": "slow", "requests_per_minute": 2, "name": "slow-ci"},
    )
    clock = Clock()
    keys = KeyFile(str(path), clock)
    bus = InMemoryBus()
    service = GatewayService(bus, SUBJECTS, "gw1", submit_timeout_s=1)
    fake = FakeScheduler(bus, served)
    store = ResponseStore(bus, SUBJECTS.responses_bucket, 60)

    async def startup() -> None:
        await service.start()
        await store.start()
        await fake.start()

    with TestClient(build_app(service, served, store, keys=keys)) as client:
        assert client.portal is not None
        client.portal.call(startup)
        yield Harness(client, fake, keys, path, clock)


def openai_key(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def check_401(resp: Any, path: str) -> None:
    assert resp.status_code == 401, (path, resp.text)
    body = resp.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] in ("missing_api_key", "invalid_api_key")
    assert ACME not in resp.text


@pytest.mark.parametrize("path", [*POSTS, *GETS])
def test_every_v1_route_needs_a_known_key(harness: Harness, path: str) -> None:
    client = harness.client
    call = (
        (lambda h: client.post(path, json=POSTS[path], headers=h))
        if path in POSTS
        else (lambda h: client.get(path, headers=h))
    )
    for headers in ({}, openai_key("sk-di-wrong"), {"x-api-key": "sk-di-wrong"}, {"Authorization": ACME}):
        check_401(call(headers), path)
    assert not harness.fake.submitted


@pytest.mark.parametrize("path", list(POSTS))
def test_a_known_key_is_served_as_its_tenant(harness: Harness, path: str) -> None:
    headers = {"x-api-key": ACME} if path.startswith("/v1/messages") else openai_key(ACME)
    resp = harness.client.post(path, json=POSTS[path], headers=headers)
    assert resp.status_code == 200, resp.text
    assert "x-ratelimit-limit-requests" not in resp.headers  # this key has no limit
    if path.endswith("count_tokens"):
        return
    (submitted,) = harness.fake.submitted
    assert submitted.tenant == "acme" and submitted.priority == 2 and submitted.tenant_weight == 3


def test_the_open_routes_stay_open(harness: Harness) -> None:
    assert harness.client.get("/livez").status_code == 200
    assert harness.client.get("/metrics").status_code == 200
    assert harness.client.get("/health").status_code in (200, 503)  # no members on this bus: 503


def test_the_key_decides_the_tenant_not_a_header(harness: Harness) -> None:
    # Both APIs' headers: each route reads its own API's first, and BETA is in neither's place.
    headers = {**openai_key(BETA), "x-api-key": ACME}
    assert harness.client.post("/v1/chat/completions", json=BODY, headers=headers).status_code == 200
    assert harness.client.post("/v1/messages", json=MESSAGES_BODY, headers=headers).status_code == 200
    assert [s.tenant for s in harness.fake.submitted] == ["beta", "acme"]


def test_a_key_past_its_limit_waits(harness: Harness) -> None:
    client, clock = harness.client, harness.clock
    seen = []
    for _ in range(2):
        resp = client.post("/v1/chat/completions", json=BODY, headers=openai_key(SLOW))
        assert resp.status_code == 200
        seen.append(resp.headers["x-ratelimit-remaining-requests"])
        assert resp.headers["x-ratelimit-limit-requests"] == "2"
    assert seen == ["1", "0"]
    refused = client.post("/v1/chat/completions", json=BODY, headers=openai_key(SLOW))
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "30"  # 2 a minute: one every 30 s
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"] == "1m0s"
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "slow-ci" in error["message"]
    # Anthropic's shape and headers on the Messages route
    anthropic = client.post("/v1/messages", json=MESSAGES_BODY, headers={"x-api-key": SLOW})
    assert anthropic.status_code == 429 and anthropic.json()["error"]["type"] == "rate_limit_error"
    assert anthropic.headers["anthropic-ratelimit-requests-limit"] == "2"
    # other keys are not slowed
    assert client.post("/v1/chat/completions", json=BODY, headers=openai_key(BETA)).status_code == 200
    clock.now += 30
    assert client.post("/v1/chat/completions", json=BODY, headers=openai_key(SLOW)).status_code == 200
    assert harness.metric("deepinfer_tenant_rate_limited_total", tenant="slow") == 2
    assert harness.metric("deepinfer_requests_total", api="chat", outcome="rate_limited") == 1
    assert harness.metric("deepinfer_requests_total", api="messages", outcome="rate_limited") == 1
    assert harness.metric("deepinfer_requests_total", api="chat", outcome="queue_full") == 0


def test_usage_is_counted_per_tenant(harness: Harness) -> None:
    harness.fake.cached = 3
    for key in (ACME, ACME, BETA):
        resp = harness.client.post("/v1/chat/completions", json=BODY, headers=openai_key(key))
        assert resp.status_code == 200
    usage = resp.json()["usage"]
    per_request = {
        "output": usage["completion_tokens"],
        "input_cached": 3,
        "input_uncached": usage["prompt_tokens"] - 3,
    }
    for tenant, times in (("acme", 2), ("beta", 1)):
        for kind, count in per_request.items():
            assert harness.metric("deepinfer_tenant_tokens_total", tenant=tenant, kind=kind) == times * count


def test_a_reload_changes_the_keys_and_a_bad_file_changes_nothing(harness: Harness) -> None:
    client, path = harness.client, harness.path
    new = "sk-di-new"
    write_keys(path, {"sha256": hash_key(new), "tenant": "new"}, {"sha256": hash_key(BETA), "tenant": "beta"})
    assert harness.keys.reload()
    assert client.post("/v1/chat/completions", json=BODY, headers=openai_key(new)).status_code == 200
    chat = "/v1/chat/completions"
    check_401(client.post(chat, json=BODY, headers=openai_key(ACME)), chat)
    path.write_text('{"keys": [{"sha256": "oops", "tenant": "x"}]}')
    assert not harness.keys.reload()
    assert client.post("/v1/chat/completions", json=BODY, headers=openai_key(new)).status_code == 200
    path.unlink()
    assert not harness.keys.reload()
    assert client.post("/v1/chat/completions", json=BODY, headers=openai_key(BETA)).status_code == 200
    harness.keys.table.check_integrity()


def test_a_bad_keys_file_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="api_keys_file"):
        KeyFile(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        KeyFile(str(tmp_path / "bad.json"))


def test_a_replayed_stream_is_not_counted_twice(harness: Harness) -> None:
    headers = openai_key(ACME)
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    with harness.client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: {")]
    request_id = json.loads(lines[0][6:])["id"]
    counted = harness.metric("deepinfer_tenant_tokens_total", tenant="acme", kind="output")
    revenue = harness.metric("deepinfer_revenue_dollars_total", kind="output")
    assert counted > 0 and revenue > 0
    replay = harness.client.get(f"/v1/chat/completions/{request_id}?stream=true", headers=headers)
    assert replay.status_code == 200 and replay.text.count("data: {") == len(lines)  # the whole stream again
    assert harness.metric("deepinfer_tenant_tokens_total", tenant="acme", kind="output") == counted
    assert harness.metric("deepinfer_revenue_dollars_total", kind="output") == revenue
