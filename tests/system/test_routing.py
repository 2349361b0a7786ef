"""Routing across scheduler replicas (real processes, real nats-server, SmolLM2): two replicas,
each owning one worker; the gateway's KV router sends a prompt back to the worker that holds it,
through that worker's replica, even where every tie-break would pick the other one. (That a
worker's removals stop it being preferred, and gap -> dump, are the unit and service tests'.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from libs.protocol.messages import MemberKind
from tests.system.faults import MODEL, InFlight
from tests.system.stack import Stack, latest_loads, wait_member_id

SECOND = "worker-test-2"  # sorts after the stack's "worker-test": every tie goes to the first
REPLICA = "scheduler-test-2"
BLOCK_SIZE = 16
NOTES = " ".join(f"Entry {i}: the tide rose {i % 5} feet at the {i}th bell." for i in range(30))


def body(topic: str, max_tokens: int = 8, notes: str = NOTES) -> dict[str, Any]:
    messages = [{"role": "system", "content": notes}, {"role": "user", "content": f"About {topic}?"}]
    sampling = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return {"model": MODEL, "messages": messages, **sampling}


def chat(stack: Stack, topic: str) -> dict[str, Any]:
    resp = httpx.post(f"{stack.base_url}/chat/completions", json=body(topic), timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def routes(stack: Stack) -> dict[str, float]:
    """The gateway's ``deepinfer_router_routes_total`` per worker."""
    text = httpx.get(f"{stack.root_url}/metrics", timeout=10).text
    return {
        sample.labels["worker_id"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "deepinfer_router_routes"
        for sample in family.samples
    }


def routed_to(stack: Stack, send: Any) -> str:
    """The worker the router sent the request ``send()`` makes (it must send exactly one)."""
    before = routes(stack)
    send()
    after = routes(stack)
    (worker_id,) = [w for w in after if after[w] > before.get(w, 0)]
    assert sum(after.values()) == sum(before.values()) + 1
    return worker_id


def owners(nats_url: str) -> dict[str, str]:
    """Each worker's owner, from its last load report."""
    return {w: load.owner for w, load in asyncio.run(latest_loads(nats_url)).items()}


@pytest.fixture(scope="module")
def replicas(model_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The stack's scheduler owns its worker; a second replica joins and, driving fewer workers,
    gets the second worker (the first leaves a free worker to it)."""
    tmp = tmp_path_factory.mktemp("routing")
    stack = Stack.start(model_cache_dir, tmp / "stack.log", dtype="float32", kv_store=tmp / "kv-store")
    try:
        stack.add_scheduler(REPLICA)
        asyncio.run(wait_member_id(stack.nats.url, MemberKind.SCHEDULER, REPLICA, 120))
        time.sleep(2.0)  # the first replica's view of the members has the second in it
        stack.add_worker(SECOND)
        deadline = time.monotonic() + 180
        while (seen := owners(stack.nats.url)).get(SECOND) != REPLICA:
            assert time.monotonic() < deadline, f"the second replica did not claim {SECOND}: {seen}"
        assert seen[stack.worker_id] not in ("", REPLICA), seen
        yield stack
    finally:
        stack.stop()


def test_a_prompt_goes_back_to_the_worker_holding_it_through_its_replica(replicas: Stack) -> None:
    stack = replicas
    # A long stream keeps the first worker busy, so the prompts below are first computed on the
    # second (by load); once it ends, both are idle and a tie would pick the first.
    busy = InFlight(stack.base_url, "chat", body("bells", max_tokens=160, notes="Unrelated."), 300)
    busy.wait_tokens(2, 120)
    topics = ("gulls", "storms", "boats")
    firsts = {t: routed_to(stack, lambda t=t: chat(stack, t)) for t in topics}
    assert set(firsts.values()) == {SECOND}, firsts
    assert busy.result().kind == "completed"
    for topic in topics:
        worker_id = routed_to(stack, lambda t=topic: chat(stack, t))
        assert worker_id == SECOND, topic  # found there, not the tie-break's pick
    again = chat(stack, topics[0])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK_SIZE * 10
    log = stack.log.read_text()
    assert f"scheduler {REPLICA} ready" in log
