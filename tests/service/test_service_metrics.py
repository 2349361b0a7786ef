"""The scheduler's and kvcache's Prometheus metrics over their real services (in-memory bus, the
scripted worker): queue gauges read from the cores, steps, preemptions, sequences failed alone,
worker losses; and a /metrics port served by prometheus_client, scraped over HTTP. Everything is
read back with prometheus_client's parser."""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from libs.bus.nats_server import free_port
from libs.protocol.messages import FinishReason, ModelRunnerOutput, SchedulerOutput, StepOutputs, SubmitStatus
from libs.runtime.metrics_server import start_metrics_server
from services.kvcache import metrics as kvcache_metrics
from services.scheduler import metrics as scheduler_metrics
from services.scheduler.config import Config
from tests.service.kvcache_harness import Clock, Publisher, lookup, running, stored
from tests.service.scheduler_harness import running_service, submit
from tests.unit.kvcache.test_store_scan import put
from tests.unit.scheduler.fake_worker import VOCAB, next_token

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(registry: CollectorRegistry) -> Samples:
    return parse(generate_latest(registry).decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def until(cond: Callable[[], object]) -> None:
    for _ in range(1_000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


async def finished(outputs: asyncio.Queue[StepOutputs], num_requests: int) -> dict[str, FinishReason]:
    """Each request's finish reason, once every one of ``num_requests`` has one."""
    finishes: dict[str, FinishReason] = {}
    while len(finishes) < num_requests:
        step = await asyncio.wait_for(outputs.get(), 5)
        finishes |= {o.request_id: o.finish_reason for o in step.outputs if o.finish_reason is not None}
    return finishes


async def test_running_and_waiting_are_read_from_the_cores_when_scraped() -> None:
    async with running_service(Config(scheduler_id="s1", max_num_waiting=8)) as (service, bus, worker, out):
        registry = scheduler_metrics.registry(service.workers)
        await until(lambda: worker.plans)  # the claim went through
        worker.gate.clear()  # the next step is held at the worker
        assert (await submit(bus, "r1", max_tokens=3)).status is SubmitStatus.ACCEPTED
        await until(lambda: service.workers["w1"].core.num_running == 1)
        for i in range(2, 7):  # queued behind the held step
            assert (await submit(bus, f"r{i}", max_tokens=3)).status is SubmitStatus.ACCEPTED
        held = scrape(registry)
        assert value(held, "deepinfer_num_requests_running", worker_id="w1") == 1
        assert value(held, "deepinfer_num_requests_waiting", worker_id="w1") == 5
        num_blocks = service.workers["w1"].core.limits.num_blocks
        num_free = value(held, "deepinfer_num_free_kv_blocks", worker_id="w1")
        assert num_free < num_blocks  # r1's
        usage = value(held, "deepinfer_kv_cache_usage_perc", worker_id="w1")
        assert usage == pytest.approx(1 - num_free / num_blocks) and usage > 0
        queued = value(held, "deepinfer_request_queue_time_seconds_count")
        worker.gate.set()
        assert set((await finished(out, 6)).values()) == {FinishReason.LENGTH}
        await until(lambda: not service.workers["w1"].core.has_work())
        done = scrape(registry)
        assert value(done, "deepinfer_num_requests_running", worker_id="w1") == 0
        assert value(done, "deepinfer_num_requests_waiting", worker_id="w1") == 0
        assert value(done, "deepinfer_num_free_kv_blocks", worker_id="w1") == num_blocks
        assert value(done, "deepinfer_kv_cache_usage_perc", worker_id="w1") == 0
        assert value(done, "deepinfer_steps_total") > value(held, "deepinfer_steps_total")
        # the five queued behind the held step were admitted since: each queue time observed once
        assert value(done, "deepinfer_request_queue_time_seconds_count") == queued + 5


async def test_a_sequence_failed_alone_a_preemption_and_a_lost_worker_are_counted() -> None:
    before = scrape(scheduler_metrics.EVENTS)
    async with running_service(Config(scheduler_id="s1")) as (_service, bus, worker, out):
        execute, failed = worker.runner.execute, []

        def fail_one(plan: SchedulerOutput) -> ModelRunnerOutput:
            result = execute(plan)
            if "bad" in result.seq_ids and not failed:
                failed.append("bad")
                why = ("structured output: the grammar failed to compile",)
                return dataclasses.replace(result, failed_seq_ids=("bad",), failed_errors=why)
            return result

        worker.runner.execute = fail_one  # type: ignore[method-assign]
        await until(lambda: worker.plans)  # the claim went through
        worker.gate.clear()  # all are queued before the first step: they run together
        await submit(bus, "bad", max_tokens=5)
        # 4 sequences of up to 53 tokens need 56 blocks of 4 tokens: the worker has 32.
        for i in range(4):
            await submit(bus, f"long{i}", max_tokens=50)
        worker.gate.set()
        finishes = await finished(out, 5)
        assert finishes["bad"] is FinishReason.ERROR
        assert {finishes[f"long{i}"] for i in range(4)} == {FinishReason.LENGTH}
        worker.owner = "s2"  # another scheduler took the worker
        await worker.publish_load()
        await until(lambda: "w1" not in _service.workers)
    after = scrape(scheduler_metrics.EVENTS)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("deepinfer_sequences_failed_total", reason="structured_output") == 1
    assert delta("deepinfer_preemptions_total") > 0
    assert delta("deepinfer_worker_losses_total", reason="taken") == 1
    # a step answered after its worker was dropped is timed, never applied
    assert 0 < delta("deepinfer_steps_total") <= delta("deepinfer_step_seconds_count")


async def test_the_kvcache_metrics_port_serves_its_index_and_counters(tmp_path: Path) -> None:
    async with running(tmp_path, Clock()) as (bus, svc):
        agent = [put(tmp_path, i) for i in range(3)]
        chat = [put(tmp_path, 10, cls="chat")]
        await Publisher(bus, svc).send(stored(agent), stored(chat))
        assert await lookup(bus, agent[:2]) == 2
        port = free_port()
        server = start_metrics_server(port, kvcache_metrics.registry(svc), "127.0.0.1")
        assert server is not None
        try:
            url = f"http://127.0.0.1:{port}/metrics"
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        finally:
            server.shutdown()
            server.server_close()
    samples = parse(body.decode())
    assert value(samples, "deepinfer_kvcache_index_blocks") == 4
    assert value(samples, "deepinfer_kvcache_stored_blocks", retention_class="agent") == 3
    assert value(samples, "deepinfer_kvcache_stored_blocks", retention_class="chat") == 1
    assert ("deepinfer_kvcache_stored_blocks", frozenset({("retention_class", "total")})) not in samples
    assert value(samples, "deepinfer_kvcache_lookups_total") == 1
    assert value(samples, "deepinfer_kvcache_lookup_hit_blocks_total") == 2
    assert value(samples, "deepinfer_kvcache_evicted_blocks_total", reason="expired") == 0
    assert any(name == "process_cpu_seconds_total" for name, _ in samples)
    assert start_metrics_server(0, kvcache_metrics.registry(svc)) is None  # port 0: not served


async def test_speculative_drafts_are_counted_per_worker_and_source() -> None:
    config = Config(scheduler_id="s1", speculative_method="ngram", speculative_max_tokens=3)
    async with running_service(config) as (service, bus, worker, out):
        registry = scheduler_metrics.registry(service.workers)
        await until(lambda: worker.plans)
        # The scripted worker's first token is y: "t y" came before, so the scheduler drafts "9 9 t"
        pairs = ((t, y) for t in range(VOCAB) for y in range(VOCAB))
        repeating = next(p for t, y in pairs if next_token(p := [t, y, 9, 9, t]) == y)
        assert (await submit(bus, "r1", max_tokens=6, prompt=repeating)).status is SubmitStatus.ACCEPTED
        assert set((await finished(out, 1)).values()) == {FinishReason.LENGTH}
        samples = scrape(registry)
        where = {"worker_id": "w1", "source": "ngram"}
        drafted = value(samples, "deepinfer_spec_draft_tokens_total", **where)
        verified = value(samples, "deepinfer_spec_verifications_total", **where)
        assert drafted >= verified > 0
        assert 0 <= value(samples, "deepinfer_spec_accepted_tokens_total", **where) <= drafted
        assert any(plan.draft_token_ids for plan in worker.plans)
