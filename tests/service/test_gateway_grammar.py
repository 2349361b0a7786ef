"""The gateway's grammar check through the HTTP app (in process, in-memory bus, no scheduler): a
regex whose outlines index explodes is a 400 in the API's error shape naming the compile's time
bound, its compiler process is killed, and a repeat is answered from the cache without another
compile; a fine constraint passes the check (and then finds no scheduler: 503)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from libs.bus.memory import InMemoryBus
from libs.grammar.sandbox import CompileLimits
from libs.protocol.subjects import Subjects
from services.gateway.app import build_app
from services.gateway.response_store import ResponseStore
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService

SUBJECTS = Subjects()
# outlines-core builds a DFA of about 2**22 states for this (minutes, gigabytes): "an 'a' 22
# characters before the end" must remember the last 22 characters.
HOSTILE = "[ab]*a[ab]{22}"


def body(regex: str) -> dict[str, object]:
    return {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "response_format": {"type": "regex", "regex": regex},
    }


@pytest.fixture(scope="module")
def served(model_cache_dir: Path) -> Iterator[ServedModel]:
    limits = CompileLimits(timeout_s=2, num_procs=1)
    served = ServedModel.load("smollm2", str(model_cache_dir), "", 0, "template", "outlines", limits)
    yield served
    assert served.grammar is not None
    served.grammar.close()


@pytest.fixture
def client(served: ServedModel) -> Iterator[TestClient]:
    bus = InMemoryBus()
    service = GatewayService(bus, SUBJECTS, "gw1", submit_timeout_s=0.2)
    store = ResponseStore(bus, SUBJECTS.responses_bucket, 60)

    async def startup() -> None:
        await service.start()
        await store.start()

    with TestClient(build_app(service, served, store, 1)) as client:
        assert client.portal is not None
        client.portal.call(startup)
        yield client


def test_a_hostile_regex_is_a_400_naming_the_bound_and_is_not_compiled_twice(
    client: TestClient, served: ServedModel
) -> None:
    assert served.grammar is not None
    served.grammar.warm("outlines")
    [pid] = served.grammar.pids()
    resp = client.post("/v1/chat/completions", json=body(HOSTILE))
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "response_format"
    assert "grammar compilation exceeded 2 s" in error["message"]
    assert not os.path.exists(f"/proc/{pid}")  # killed: its CPU stopped
    [fresh] = served.grammar.pids()
    again = client.post("/v1/chat/completions", json=body(HOSTILE))
    assert again.status_code == 400 and again.json()["error"]["message"] == error["message"]
    assert served.grammar.pids() == [fresh]  # answered from the cache: no compile killed
    # the service goes on: a fine regex passes the check, then finds no scheduler
    assert client.post("/v1/chat/completions", json=body("[a-z]{3,8}")).status_code == 503
