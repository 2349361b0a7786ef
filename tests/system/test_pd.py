"""Prefill/decode disaggregation over real processes (nats-server, SmolLM2 in fp32): a long
uncached prompt is prefilled on a `--role prefill` worker, which samples and streams the first
token, and decoded on a `--role decode` worker that loads the prompt's full blocks from the shared
store and the partial last block from the handoff area. The text equals colocated serving, and
the decode worker computed only the first output token's KV itself: its G3 loads cover every
full prompt block and its handoff load the partial one, none failed, and the handoff file is gone
once loaded. A client that leaves during the remote prefill leaves no block held on either worker
and no handoff file.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from libs.bus.nats_server import free_port
from libs.kvstore.block_file import TEMP_FILE_SUFFIX
from services.worker.handoff_area import HANDOFF_DIR_NAME
from tests.system.faults import MODEL, InFlight
from tests.system.kv_metrics import scheduler_kv_stat
from tests.system.stack import Stack
from tests.system.test_worker_drain import wait_workers

PREFILL = "worker-prefill"
BLOCK_SIZE = 16  # the workers' default
STORY = " ".join(f"Day {i}: the keeper lit the lamp and counted {i + 3} ships." for i in range(20))
QUESTIONS = ("How many ships on day 7?", "What did the keeper light?")


def body(question: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": STORY}, {"role": "user", "content": question}]
    sampling = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    return {"model": MODEL, "messages": messages, **sampling}


def chat(stack: Stack, question: str, api_key: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"}  # the key is the tenant: the KV is not shared
    url = f"{stack.base_url}/chat/completions"
    resp = httpx.post(url, json=body(question), headers=headers, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def kv_counter(stack: Stack, name: str, label: str) -> float:
    return scheduler_kv_stat(stack.root_url, name, label)


@pytest.fixture(scope="module")
def scheduler_metrics_port() -> int:
    """Taken when the stack starts, not at import: a port free then may be any process's later."""
    return free_port()


@pytest.fixture(scope="module")
def stack(
    model_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory, scheduler_metrics_port: int
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("pd")
    running = Stack.start(
        model_cache_dir,
        tmp / "stack.log",
        kv_store=tmp / "kv-store",
        worker_args=("--role", "decode"),
        scheduler_args=("--pd-min-uncached-tokens", "64", "--metrics-port", str(scheduler_metrics_port)),
    )
    try:
        yield running
    finally:
        running.stop()


def test_a_long_prompt_is_prefilled_on_one_worker_and_decoded_on_another_with_the_same_text(
    stack: Stack,
) -> None:
    # Colocated first: with no prefill worker up, the decode worker serves the whole request.
    colocated = {q: chat(stack, q, "colocated") for q in QUESTIONS}
    stack.add_worker(PREFILL, "--role", "prefill")
    asyncio.run(wait_workers(stack.nats.url, {stack.worker_id, PREFILL}, 180))
    for i, question in enumerate(QUESTIONS):
        loaded = kv_counter(stack, "loaded_blocks", "G3")
        failed = kv_counter(stack, "failed_load_blocks", "all")
        partial = kv_counter(stack, "loaded_partial_blocks", "all")
        failed_partial = kv_counter(stack, "failed_partial_blocks", "all")
        # A tenant of its own each: nothing of the prompt is cached anywhere, so it goes P/D.
        auth = {"Authorization": f"Bearer pd-{i}"}
        stream = InFlight(stack.base_url, "chat", body(question), 120, headers=auth)
        end = stream.result()
        assert end.kind == "completed", end
        assert stream.state.text == colocated[question]["choices"][0]["message"]["content"]
        num_prompt = colocated[question]["usage"]["prompt_tokens"]
        assert num_prompt % BLOCK_SIZE, "the prompt must end in a partial block"
        deadline = time.monotonic() + 10  # the scheduler publishes its counters every 0.2 s
        while (
            kv_counter(stack, "loaded_blocks", "G3") - loaded < num_prompt // BLOCK_SIZE
            or kv_counter(stack, "loaded_partial_blocks", "all") - partial < 1
        ):
            assert time.monotonic() < deadline, "the decode worker did not load the prompt's blocks"
            time.sleep(0.1)
        assert kv_counter(stack, "loaded_blocks", "G3") - loaded == num_prompt // BLOCK_SIZE
        assert kv_counter(stack, "loaded_partial_blocks", "all") - partial == 1
        assert kv_counter(stack, "failed_load_blocks", "all") == failed
        assert kv_counter(stack, "failed_partial_blocks", "all") == failed_partial
        assert handoff_files(stack) == []  # deleted once loaded
    log = stack.log.read_text()
    assert log.count(f"from {PREFILL} to {stack.worker_id}") >= len(QUESTIONS), log[-3000:]


def handoff_files(stack: Stack) -> list[Path]:
    area = stack.kv_store / HANDOFF_DIR_NAME
    return [p for p in area.rglob("*") if p.is_file()] if area.exists() else []


def scheduler_gauges(port: int, name: str) -> dict[str, float]:
    """The scheduler's gauge ``name`` per worker id, from its own /metrics on ``port``."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        sample.labels["worker_id"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for sample in family.samples
    }


def test_a_cancel_during_the_remote_prefill_frees_the_blocks_on_both_workers(
    stack: Stack, scheduler_metrics_port: int
) -> None:
    """A long prompt goes to the prefill worker; its client leaves while it is computed there.
    Both workers' free KV blocks come back to what they were, and neither the store nor the
    handoff area holds a file of it."""
    workers = {stack.worker_id, PREFILL}
    baseline = scheduler_gauges(scheduler_metrics_port, "deepinfer_num_free_kv_blocks")
    assert set(baseline) == workers, baseline
    story = " ".join(f"Night {i}: the keeper wrote down {i * 7} waves and a gull." for i in range(150))
    messages = [{"role": "system", "content": story}, {"role": "user", "content": "Sum it up."}]
    request = {"model": MODEL, "messages": messages, "max_tokens": 64, "temperature": 0}

    async def leave_during_prefill() -> float:
        async with httpx.AsyncClient(timeout=120) as http:
            headers = {"Authorization": "Bearer cancel-in-prefill"}  # nothing of it cached
            call = asyncio.create_task(
                http.post(f"{stack.base_url}/chat/completions", json=request, headers=headers)
            )
            deadline = time.monotonic() + 60
            while (
                scheduler_gauges(scheduler_metrics_port, "deepinfer_num_requests_running").get(PREFILL, 0) < 1
            ):
                assert not call.done(), call.result().text
                assert time.monotonic() < deadline, "the request never ran on the prefill worker"
                await asyncio.sleep(0.05)
            held = scheduler_gauges(scheduler_metrics_port, "deepinfer_num_free_kv_blocks")[PREFILL]
            call.cancel()  # the client leaves: its connection closes
            with contextlib.suppress(asyncio.CancelledError):
                await call
            return held

    held = asyncio.run(leave_during_prefill())
    assert held < baseline[PREFILL]  # the prompt's blocks were held there when the client left
    deadline = time.monotonic() + 15
    while (free := scheduler_gauges(scheduler_metrics_port, "deepinfer_num_free_kv_blocks")) != baseline:
        assert time.monotonic() < deadline, (free, baseline)
        time.sleep(0.1)
    assert not [p for p in stack.kv_store.rglob("*") if p.name.endswith(TEMP_FILE_SUFFIX)]
    assert handoff_files(stack) == []
    assert "cancelled" in stack.log.read_text()


def test_with_only_a_prefill_worker_a_request_is_a_503_naming_the_role(stack: Stack) -> None:
    assert stack.worker is not None
    stack.worker.kill()  # the decode worker
    deadline = time.monotonic() + 30
    while True:
        resp = httpx.post(f"{stack.base_url}/chat/completions", json=body(QUESTIONS[0]), timeout=60)
        if resp.status_code == 503 and "decode role" in resp.text:
            break
        assert time.monotonic() < deadline, resp.text
        time.sleep(0.5)
    assert resp.json()["error"]["message"]
