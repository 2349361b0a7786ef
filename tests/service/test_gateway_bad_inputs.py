"""The bad-input table and the fuzzer's cases in-process (starlette TestClient over the in-memory
bus, a fake scheduler that runs what is admitted): no 5xx, each error in the API's shape, the
next request served. The system tests run the same tables against real processes and NATS."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from libs.bus.memory import InMemoryBus
from libs.protocol.subjects import Subjects
from services.gateway.app import build_app
from services.gateway.response_store import ResponseStore
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService
from tests.service.test_gateway_app import FakeScheduler
from tests.system.bad_inputs import GOOD_BODY, GOOD_PATH, Case, all_cases, check_error_shape
from tests.system.test_fuzz import fuzz_cases


@pytest.fixture(scope="module")
def client(model_cache_dir: Path) -> Iterator[TestClient]:
    served = ServedModel.load("smollm2", str(model_cache_dir), "", 0)
    subjects, bus = Subjects(), InMemoryBus()
    service = GatewayService(bus, subjects, "gw1", submit_timeout_s=1)
    store = ResponseStore(bus, subjects.responses_bucket, 60)
    fake = FakeScheduler(bus, served)

    async def startup() -> None:
        await service.start()
        await store.start()
        await fake.start()

    # A server error must come back as the client sees it (a 500), not raise in the test.
    with TestClient(build_app(service, served, store), raise_server_exceptions=False) as running:
        running.portal.call(startup)  # type: ignore[union-attr]
        yield running


def problems(client: TestClient, cases: list[Case]) -> list[str]:
    found = []
    for case in cases:
        why = check_error_shape(case.send(client), case.shape)
        if why is not None:
            found.append(f"{case.name}: {why}")
        good = client.post(GOOD_PATH, json=GOOD_BODY)
        if good.status_code != 200:
            found.append(f"after {case.name}: {good.status_code} {good.text[:200]}")
    return found


def test_the_bad_input_table(client: TestClient) -> None:
    found = problems(client, all_cases())
    assert not found, "\n".join(found[:40])


def test_the_fuzzed_cases(client: TestClient) -> None:
    found = problems(client, fuzz_cases(random.Random("system-fuzz-1")))
    assert not found, "\n".join(found[:40])


def test_an_unknown_route_and_method_answer_in_the_apis_shape(client: TestClient) -> None:
    resp = client.get("/v1/messages/a/b")
    assert resp.status_code == 404 and resp.json()["type"] == "error"
    resp = client.get("/v1/chat/completions")
    assert resp.status_code == 405 and resp.json()["error"]["type"] == "invalid_request_error"
    assert resp.headers["allow"] == "POST"
