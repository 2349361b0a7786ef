"""The HTTP layer in-process (starlette TestClient) over the in-memory bus: admission errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from libs.bus.base import Message
from libs.bus.memory import InMemoryBus
from libs.protocol.codec import encode
from libs.protocol.messages import SubmitReply, SubmitStatus
from libs.protocol.subjects import Subjects
from services.gateway.app import build_app
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService

SUBJECTS = Subjects()
BODY = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def served(model_cache_dir: Path) -> ServedModel:
    return ServedModel.load("smollm2", str(model_cache_dir), "", 0)


@pytest.fixture
def client_with(served: ServedModel) -> Iterator[object]:
    def make(status: SubmitStatus | None) -> TestClient:
        bus = InMemoryBus()
        service = GatewayService(bus, SUBJECTS, "gw1", submit_timeout_s=1)

        async def on_submit(msg: Message) -> None:
            assert status is not None
            await bus.respond(msg, encode(SubmitReply(status, "nope")))

        async def startup() -> None:
            await service.start()
            if status is not None:
                await bus.subscribe(SUBJECTS.submit, on_submit)

        client = TestClient(build_app(service, served))
        client.__enter__()  # the portal's event loop now runs until __exit__
        assert client.portal is not None
        client.portal.call(startup)
        clients.append(client)
        return client

    clients: list[TestClient] = []
    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.mark.parametrize(
    ("status", "http_status"),
    [
        (SubmitStatus.QUEUE_FULL, 429),
        (None, 503),
        (SubmitStatus.NO_WORKERS, 503),
        (SubmitStatus.INVALID, 400),
    ],
)
def test_admission_errors_map_to_http(client_with, status: SubmitStatus | None, http_status: int) -> None:  # type: ignore[no-untyped-def]
    client = client_with(status)
    resp = client.post("/v1/chat/completions", json=BODY)
    assert resp.status_code == http_status
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    if http_status == 429:
        assert resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["code"] == "queue_full"
    assert client.get("/health").status_code == 503  # no live worker or scheduler members
