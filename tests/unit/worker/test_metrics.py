"""The worker's metrics module: a step's time and its sequences failed alone, by reason, as a
scrape reads them (prometheus_client's parser); how an error becomes a bounded label."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from libs.protocol.errors import failure_reason
from libs.protocol.messages import ModelRunnerOutput
from services.worker import metrics


def scrape() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(metrics.EVENTS).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_step_is_timed_and_its_failed_sequences_counted_by_reason() -> None:
    before = scrape()
    errors = ("structured output: the grammar failed to compile", "structured output: timed out", "0x1f")
    result = ModelRunnerOutput(
        7, ("a", "b", "c", "d"), b"", 4, failed_seq_ids=("a", "b", "c"), failed_errors=errors
    )
    metrics.observe_step(0.02, result)
    metrics.GRAMMAR_COMPILE_TIMEOUTS.inc()
    after = scrape()

    def delta(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("deepinfer_worker_sequences_failed_total", reason="structured_output") == 2
    assert delta("deepinfer_worker_sequences_failed_total", reason="other") == 1
    assert delta("deepinfer_worker_step_seconds_count") == 1
    assert delta("deepinfer_worker_step_seconds_bucket", le="0.025") == 1
    assert delta("deepinfer_worker_step_seconds_bucket", le="0.01") == 0
    assert delta("deepinfer_grammar_compile_timeouts_total") == 1
    assert delta("deepinfer_worker_step_sequences_count") == 1
    assert delta("deepinfer_worker_step_sequences_bucket", le="4.0") == 1
    assert delta("deepinfer_worker_step_sequences_bucket", le="2.0") == 0


def test_failure_reasons_are_the_leading_words_or_other() -> None:
    assert failure_reason("structured output: bad schema at $.x") == "structured_output"
    assert failure_reason("Worker lost") == "worker_lost"
    assert failure_reason("") == "other"
    assert failure_reason("step 12 failed: boom") == "other"  # numbers: free text
    assert failure_reason("x" * 41 + ": long") == "other"
