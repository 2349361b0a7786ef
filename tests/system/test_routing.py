"""Routing and faults across scheduler replicas (real processes, real nats-server, SmolLM2): two
replicas, each owning one worker. The gateway's KV router sends a prompt back to the worker that
holds it, through that worker's replica, even where every tie-break would pick the other one; a
worker's kill -9 moves its streams to the other replica (its own has no other worker: it hands
them back to the gateway); a scheduler's kill -9 moves its streams, a resumed one among them, to
the other replica, and new requests meanwhile are served there, never refused. Fault-free texts
are the reference (fp32 greedy). A gateway started late meets the workers' event streams mid-way,
asks for dumps, and finds there a prompt cached before it started. Once the second worker has
evicted a prompt it held, its BlockRemoved events stop the router preferring it. (A gap within a
stream is the unit and service tests'.) The tests run in order on this module's stack.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from libs.bus.nats_server import free_port
from libs.protocol.member_messages import MemberKind
from tests.system.faults import MODEL, InFlight
from tests.system.stack import Stack, latest_loads, wait_healthy, wait_member_id
from tests.system.test_migration import next_tokens_s
from tests.system.test_resume import Api, chat_text, drop_after, resume

SECOND = "worker-test-2"  # sorts after the stack's "worker-test": every tie goes to the first
# A small G1 and no G2 on the second worker, so that a few prompts evict what it held (its
# BlockRemoved events): 0.1 GB of SmolLM2's fp32 KV is about 140 blocks of 16 tokens.
SECOND_ARGS = ("--kv-cache-gb", "0.1", "--host-cache-gb", "0")
REPLICA = "scheduler-test-2"
TOPICS = ("herons", "reefs", "fog")
LONG = 48  # tokens per stream in the fault tests: long enough to be cut mid-way
RESUMED = 160  # the resumed stream's: it runs on past its resume and the kill that follows
BLOCK_SIZE = 16
NOTES = " ".join(f"Entry {i}: the tide rose {i % 5} feet at the {i}th bell." for i in range(30))


def body(topic: str, max_tokens: int = 8, notes: str = NOTES) -> dict[str, Any]:
    messages = [{"role": "system", "content": notes}, {"role": "user", "content": f"About {topic}?"}]
    sampling = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return {"model": MODEL, "messages": messages, **sampling}


def chat(stack: Stack, topic: str, max_tokens: int = 8) -> dict[str, Any]:
    resp = httpx.post(f"{stack.base_url}/chat/completions", json=body(topic, max_tokens), timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def router_counts(root_url: str, family_name: str, label: str = "") -> dict[str, float]:
    """A gateway's router counter ``family_name`` by ``label`` (one without labels: under "")."""
    text = httpx.get(f"{root_url}/metrics", timeout=10).text
    return {
        sample.labels.get(label, ""): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == family_name
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def routes(root_url: str) -> dict[str, float]:
    """A gateway's ``deepinfer_router_routes_total`` per worker."""
    return router_counts(root_url, "deepinfer_router_routes", "worker_id")


def routed_to(stack: Stack, send: Any, root_url: str = "") -> str:
    """The worker the router (of the gateway at ``root_url``, the stack's by default) sent the
    request ``send()`` makes (it must send exactly one)."""
    root_url = root_url or stack.root_url
    before = routes(root_url)
    send()
    after = routes(root_url)
    (worker_id,) = [w for w in after if after[w] > before.get(w, 0)]
    assert sum(after.values()) == sum(before.values()) + 1
    return worker_id


def owners(nats_url: str) -> dict[str, str]:
    """Each worker's owner, from its last load report."""
    return {w: load.owner for w, load in asyncio.run(latest_loads(nats_url)).items()}


@dataclass
class Replicas:
    stack: Stack
    replica: subprocess.Popen[bytes]  # REPLICA's process (the stack's own is stack.scheduler)
    second: subprocess.Popen[bytes]  # SECOND's (the stack's own worker is stack.worker)

    def one_worker_each(self) -> dict[str, str]:
        """Wait until each replica owns one worker; returns worker id -> owner."""
        deadline = time.monotonic() + 180
        while True:
            seen = owners(self.stack.nats.url)
            if len(seen) == 2 and "" not in seen.values() and len(set(seen.values())) == 2:
                return seen
            assert time.monotonic() < deadline, f"not one worker per replica: {seen}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def replicas(model_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    """The stack's scheduler owns its worker; a second replica joins and, driving fewer workers,
    gets the second worker (the first leaves a free worker to it)."""
    tmp = tmp_path_factory.mktemp("routing")
    stack = Stack.start(model_cache_dir, tmp / "stack.log", dtype="float32", kv_store=tmp / "kv-store")
    try:
        replica = stack.add_scheduler(REPLICA)
        asyncio.run(wait_member_id(stack.nats.url, MemberKind.SCHEDULER, REPLICA, 120))
        time.sleep(2.0)  # the first replica's view of the members has the second in it
        replicas = Replicas(stack, replica, stack.add_worker(SECOND, *SECOND_ARGS))
        seen = replicas.one_worker_each()
        assert seen[SECOND] == REPLICA, seen
        yield replicas
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def undisturbed(replicas: Replicas) -> dict[str, str]:
    """Each topic's long answer, with no fault (every fault test's reference)."""
    return {t: chat(replicas.stack, t, LONG)["choices"][0]["message"]["content"] for t in TOPICS}


def test_a_prompt_goes_back_to_the_worker_holding_it_through_its_replica(replicas: Replicas) -> None:
    stack = replicas.stack
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


def test_a_gateway_started_late_asks_for_dumps_and_finds_a_prompt_held_before(replicas: Replicas) -> None:
    """A gateway that joins after the prompts above were cached meets each worker's G1 stream
    mid-way (a gap from its first event): it asks the publisher for a dump, and only the dump can
    tell it that the second worker holds "storms" (cached there before it started); without it
    both workers look empty and the tie-break picks the first."""
    stack = replicas.stack
    port = free_port()
    late = stack.spawn_gateway(port)
    root_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{root_url}/health", [late], stack.log, 120)
        # A new question under the notes, through the stack's gateway: the second worker holds
        # the notes, computes the question's blocks (more than one full block of new tokens) and
        # its replica publishes them, the late gateway's first event of that stream.
        question = (
            "the herring runs that fill the northern bays each spring, and what the old net menders say"
        )
        assert routed_to(stack, lambda: chat(stack, question)) == SECOND
        deadline = time.monotonic() + 30
        while router_counts(root_url, "deepinfer_router_dumps", "outcome").get("applied", 0) < 1:
            assert time.monotonic() < deadline, "the late gateway asked for no dump"
            time.sleep(0.2)

        def send() -> None:
            resp = httpx.post(f"{root_url}/v1/chat/completions", json=body("storms"), timeout=300)
            assert resp.status_code == 200, resp.text

        assert routed_to(stack, send, root_url) == SECOND
    finally:
        late.terminate()
        late.wait(30)


def test_once_the_worker_evicts_a_prompt_the_router_stops_preferring_it(replicas: Replicas) -> None:
    """A prompt computed on the second worker is found there (cached blocks counted); prompts
    under the notes (held there too) then evict it, and after those BlockRemoved events the same
    prompt counts no cached block and goes where the tie-break sends it, the first worker."""
    stack = replicas.stack
    evicted = body(
        "whales", notes=" ".join(f"Log {i}: the whale {i % 7} sang at depth {i * 3}." for i in range(40))
    )
    busy = InFlight(stack.base_url, "chat", body("bells", max_tokens=160, notes="Unrelated."), 300)
    busy.wait_tokens(2, 120)
    assert routed_to(stack, lambda: post(stack, evicted)) == SECOND  # by load: the first is busy
    assert busy.result().kind == "completed"
    before = blocks_of(stack)
    assert routed_to(stack, lambda: post(stack, evicted)) == SECOND  # held there
    assert blocks_of(stack) - before >= 20
    num_blocks = asyncio.run(latest_loads(stack.nats.url))[SECOND].num_kv_blocks
    i = 0
    while i * 20 < 2 * num_blocks:  # each prompt brings ~20 blocks of its own: G1 turns over twice
        filler = f"tide table {i}: " + " ".join(f"hour {h} level {(h * i) % 11}" for h in range(60))
        assert routed_to(stack, lambda f=filler: chat(stack, f, 1)) == SECOND, i  # by the notes
        i += 1
    time.sleep(1.0)  # the scheduler publishes G1 events every 0.1 s
    before = blocks_of(stack)
    assert routed_to(stack, lambda: post(stack, evicted)) == "worker-test"
    assert blocks_of(stack) == before


def blocks_of(stack: Stack) -> float:
    """The prompt blocks the stack's gateway router has found cached, over every route so far."""
    return router_counts(stack.root_url, "deepinfer_router_cached_blocks")[""]


def post(stack: Stack, request: dict[str, Any]) -> None:
    resp = httpx.post(f"{stack.base_url}/chat/completions", json=request, timeout=300)
    assert resp.status_code == 200, resp.text


def busiest(stack: Stack) -> str:
    running = {w: load.num_running_seqs for w, load in asyncio.run(latest_loads(stack.nats.url)).items()}
    worker_id = max(running, key=lambda w: running[w])
    assert running[worker_id] > 0, f"no worker holds a stream: {running}"
    return worker_id


def streams_of(stack: Stack, topics: tuple[str, ...]) -> dict[str, InFlight]:
    streams = {t: InFlight(stack.base_url, "chat", body(t, LONG), 300) for t in topics}
    for stream in streams.values():
        stream.wait_tokens(4, 120)
    return streams


def assert_undisturbed(streams: dict[str, InFlight], undisturbed: dict[str, str]) -> None:
    for topic, stream in streams.items():
        end = stream.result()
        assert end.kind == "completed", (topic, end)
        assert stream.state.text == undisturbed[topic], topic


def test_kill_9_of_a_worker_moves_its_streams_to_the_other_replica(
    replicas: Replicas, undisturbed: dict[str, str]
) -> None:
    """Its replica has no other worker: it hands the streams back, and the gateway resubmits them
    to the other replica. The worker, restarted, rejoins its replica."""
    stack = replicas.stack
    streams = streams_of(stack, TOPICS)
    victim = busiest(stack)
    proc = replicas.second if victim == SECOND else stack.worker
    assert proc is not None

    def kill() -> None:
        proc.kill()
        proc.wait()

    seconds = next_tokens_s(streams, kill)
    print(f"kill -9 of {victim} -> every stream's next token, at the other replica, within {seconds:.2f} s")
    assert_undisturbed(streams, undisturbed)
    log = stack.log.read_text()
    assert f"worker {victim} lost" in log and "moved to scheduler" in log, log[-3000:]
    if victim == SECOND:
        replicas.second = stack.add_worker(SECOND, *SECOND_ARGS)
    else:
        stack.spawn_worker()
    replicas.one_worker_each()


def test_kill_9_of_a_scheduler_moves_a_resumed_stream_and_new_requests_are_served(replicas: Replicas) -> None:
    """A stream dropped and resumed runs on one replica, which is killed: the resumed stream goes
    on at the other replica with the same text, and requests sent meanwhile get answers (the
    router leaves out the dead replica's worker; a replica with none passes the submit on), never
    a 503."""
    stack = replicas.stack
    topic = "the lighthouse keeper"
    reference = chat(stack, topic, RESUMED)["choices"][0]["message"]["content"]
    before = drop_after(stack.base_url, ask(topic), 6)
    request_id = json.loads(before[0].data)["id"]
    resumed = InFlight(
        stack.base_url,
        "chat",
        None,
        300,
        path=f"/chat/completions/{request_id}?stream=true",
        headers={"Last-Event-ID": str(before[-1].id)},
    )
    resumed.wait_tokens(2, 120)
    owner = owners(stack.nats.url)[busiest(stack)]
    victim = replicas.replica if owner == REPLICA else stack.scheduler
    assert victim is not None
    victim.kill()
    victim.wait()
    # Restarted at once, as a supervisor does (under REPLICA's id, one that keeps the id; serve's
    # restart takes a new id, as spawn_scheduler's does): it drives no worker until the dead one's
    # is let go, and the queue group (or, under REPLICA's id, the router) may pick it meanwhile.
    if owner == REPLICA:
        replicas.replica = stack.add_scheduler(REPLICA)
    else:
        stack.spawn_scheduler()
    statuses = []
    for i in range(12):  # through the time the gateway takes to see the replica gone
        resp = httpx.post(f"{stack.base_url}/chat/completions", json=body(f"gannets {i}"), timeout=120)
        statuses.append(resp.status_code)
        time.sleep(1.0)
    assert statuses == [200] * 12, statuses
    end = resumed.result()
    assert end.kind == "completed", end
    full = resume(stack.base_url, ask(topic), request_id, -1)  # the whole stream, replayed
    assert chat_text(full) == reference
    assert [e.id for e in full] == list(range(len(full)))
    assert "moved to scheduler" in stack.log.read_text()


def ask(topic: str) -> Api:
    """Chat, as the resume tests drive it, with this module's long greedy body."""
    return Api(
        "/chat/completions",
        body(topic, RESUMED),
        lambda rid, last: (f"/chat/completions/{rid}?stream=true", {"Last-Event-ID": str(last)}),
        lambda first: json.loads(first.data)["id"],
    )
