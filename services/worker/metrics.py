"""Every Prometheus metric of the worker process, served on ``--metrics-port`` (0: not served).

Events are counted in module-level metrics as they happen (one worker per process); the running
sequences are read from the runner at scrape time by ``RunnerCollector``:

- ``deepinfer_worker_step_seconds``: one step's forward (the model run of a plan), failed ones too
- ``deepinfer_worker_step_sequences``: sequences that sampled in one step (the decode batch)
- ``deepinfer_worker_num_running_seqs``: sequences whose state the runner holds
- ``deepinfer_worker_sequences_failed_total{reason}``: sequences this worker failed alone (each a
  ``ModelRunnerOutput.failed_seq_ids`` entry); reason from its error (``failure_reason``)
- ``deepinfer_grammar_compile_timeouts_total``: structured-output grammars whose compile ran past
  its time or memory bound (counted once per compile by ``services.worker.grammar_compilers.Grammars``)
- ``deepinfer_grammar_compilers_ready{backend}``: grammar compiler processes ready to compile, per
  backend started (two each by default; fewer while they start or after one was lost)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from libs.protocol.errors import failure_reason
from libs.protocol.messages import ModelRunnerOutput

if TYPE_CHECKING:  # grammar code imports this module, and the runner imports the grammar code
    from services.worker.model_runner import ModelRunner

disable_created_metrics()  # type: ignore[no-untyped-call]  # no ``*_created`` series beside each counter

EVENTS = CollectorRegistry()  # the counters and histograms of this process
ProcessCollector(registry=EVENTS)

# A decode step of a small model on a few CPU cores is ~10 ms; a long prefill chunk, seconds.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)

STEP_SECONDS = Histogram(
    "deepinfer_worker_step_seconds", "one step's forward", buckets=STEP_BUCKETS, registry=EVENTS
)
STEP_SEQUENCES = Histogram(
    "deepinfer_worker_step_sequences",
    "sequences that sampled in one step",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    registry=EVENTS,
)
SEQUENCES_FAILED = Counter(
    "deepinfer_worker_sequences_failed",
    "sequences this worker failed alone, by reason",
    ["reason"],
    registry=EVENTS,
)
GRAMMAR_COMPILE_SECONDS = Histogram(
    "deepinfer_grammar_compile_seconds",
    "from a structured output's request for its grammar to the grammar compiled (a cached one: not counted)",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=EVENTS,
)
GRAMMAR_COMPILE_TIMEOUTS = Counter(
    "deepinfer_grammar_compile_timeouts",
    "structured-output grammars whose compile ran past its bound",
    registry=EVENTS,
)


def observe_step(seconds: float, result: ModelRunnerOutput) -> None:
    """A step ran for ``seconds``; its sequences that failed alone are counted."""
    STEP_SECONDS.observe(seconds)
    if result.seq_ids:
        STEP_SEQUENCES.observe(len(result.seq_ids))
    for error in result.failed_errors:
        SEQUENCES_FAILED.labels(failure_reason(error)).inc()


class RunnerCollector(Collector):
    """The runner's sequences (a length: atomic under the GIL) and KV shape, read when scraped."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def collect(self) -> Iterator[Metric]:
        doc = "sequences whose state this worker holds"
        yield GaugeMetricFamily("deepinfer_worker_num_running_seqs", doc, value=self.runner.num_running_seqs)
        doc = "KV bytes one token costs here, all layers (the model's KV spec and the KV dtype)"
        yield GaugeMetricFamily(
            "deepinfer_worker_kv_bytes_per_token", doc, value=self.runner.kv_cache.bytes_per_token
        )
        doc = "grammar compiler processes ready to compile, by backend"
        ready = GaugeMetricFamily("deepinfer_grammar_compilers_ready", doc, labels=["backend"])
        for backend, num_ready in self.runner.grammars.compilers_ready().items():
            ready.add_metric([backend], num_ready)
        yield ready


def registry(runner: ModelRunner) -> CollectorRegistry:
    """What /metrics shows: this process's events and ``runner``'s sequences."""
    view = CollectorRegistry()
    view.register(EVENTS)
    view.register(RunnerCollector(runner))
    return view
