"""Every Prometheus metric of the scheduler process, served on ``--metrics-port`` (0: off).

Events are counted in module-level metrics as they happen (one scheduler per process); the queue
gauges are read from the cores at scrape time by ``QueueCollector``:

- ``deepinfer_num_requests_running{worker_id}``: sequences running on that worker (its core's view)
- ``deepinfer_num_requests_waiting{worker_id}``: sequences queued for that worker
- ``deepinfer_spec_draft_tokens_total{worker_id,source}``, ``deepinfer_spec_accepted_tokens_total``,
  ``deepinfer_spec_verifications_total``: speculative decoding (drafted tokens sent for
  verification, those accepted, sequence-steps that verified a draft) since that worker's core
  was made (a draft the policy cut is counted as far as it was verified). Acceptance rate is
  accepted / drafted; mean accepted length per verification is accepted / verifications
- ``deepinfer_kv_cache_usage_perc{worker_id}``: share of that worker's KV blocks in use
- ``deepinfer_request_queue_time_seconds``: from a sequence's placement to its first admission
- ``deepinfer_steps_total``: steps a worker ran and answered
- ``deepinfer_step_seconds``: from a plan's send to its result (queueing at the worker included,
  with overlap on)
- ``deepinfer_preemptions_total``: running sequences preempted (recomputed later) for KV blocks
- ``deepinfer_sequences_failed_total{reason}``: sequences a worker failed alone (a
  ``ModelRunnerOutput.failed_seq_ids`` entry); reason from its error (``failure_reason``)
- ``deepinfer_worker_losses_total{reason}``: workers dropped with their sequences: step_failed
  (no answer, or the step raised), silent (no heartbeat), stuck (in one step too long), taken
  (another scheduler owns it), connection_lost (this scheduler's NATS connection)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from libs.protocol.errors import failure_reason
from libs.runtime.tracing import parent_context, tracer

if TYPE_CHECKING:
    from services.scheduler.sequence import Sequence
    from services.scheduler.step_loop import WorkerHandle

disable_created_metrics()  # type: ignore[no-untyped-call]  # no ``*_created`` series beside each counter

EVENTS = CollectorRegistry()  # the counters and histograms of this process
ProcessCollector(registry=EVENTS)

# Steps: a decode of a small model on CPU is some ms, a long prefill chunk seconds.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)

STEPS = Counter("deepinfer_steps", "steps a worker ran and answered", registry=EVENTS)
STEP_SECONDS = Histogram(
    "deepinfer_step_seconds", "from a plan's send to its result", buckets=STEP_BUCKETS, registry=EVENTS
)
PREEMPTIONS = Counter(
    "deepinfer_preemptions", "running sequences preempted for KV blocks (recomputed later)", registry=EVENTS
)
SEQUENCES_FAILED = Counter(
    "deepinfer_sequences_failed", "sequences a worker failed alone, by reason", ["reason"], registry=EVENTS
)
WORKER_LOSSES = Counter(
    "deepinfer_worker_losses",
    "workers dropped with their sequences: step_failed, silent, stuck, taken, connection_lost",
    ["reason"],
    registry=EVENTS,
)
MIGRATIONS = Counter(
    "deepinfer_migrations",
    "sequences moved to another worker, by why: its worker crashed, left, or drains",
    ["reason"],
    registry=EVENTS,
)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
QUEUE_SECONDS = Histogram(
    "deepinfer_request_queue_time_seconds",
    "from a sequence's placement on a worker to its first admission into a plan",
    buckets=QUEUE_BUCKETS,
    registry=EVENTS,
)
HANDOFFS = Counter(
    "deepinfer_handoffs",
    "requests prefilled on a prefill worker and handed to a decode worker",
    registry=EVENTS,
)
HANDOFF_SECONDS = Histogram(
    "deepinfer_handoff_seconds",
    "from a prefilled request leaving its prefill worker to its decode worker getting it",
    buckets=STEP_BUCKETS,
    registry=EVENTS,
)


def count_failed(errors: Iterable[str]) -> None:
    """Sequences a worker failed alone, one per error."""
    for error in errors:
        SEQUENCES_FAILED.labels(failure_reason(error)).inc()


class QueueCollector(Collector):
    """Running and waiting sequences and free KV blocks per owned worker, read from the cores when
    scraped (from the server's thread: a copy of the dict and lengths, each atomic under the GIL;
    the free count's two terms may be a step apart)."""

    def __init__(self, workers: Mapping[str, WorkerHandle]) -> None:
        self.workers = workers

    def collect(self) -> Iterator[Metric]:
        labels = ["worker_id"]
        running = GaugeMetricFamily("deepinfer_num_requests_running", "sequences running", labels=labels)
        waiting = GaugeMetricFamily("deepinfer_num_requests_waiting", "sequences waiting", labels=labels)
        doc = "KV blocks allocation can take (free, or cached and unreferenced)"
        free = GaugeMetricFamily("deepinfer_num_free_kv_blocks", doc, labels=labels)
        doc = "share of the worker's KV blocks (G1) held by sequences: 1 - free / total"
        usage = GaugeMetricFamily("deepinfer_kv_cache_usage_perc", doc, labels=labels)
        spec_labels = ["worker_id", "source"]
        drafted = CounterMetricFamily(
            "deepinfer_spec_draft_tokens", "drafted tokens verified", labels=spec_labels
        )
        accepted = CounterMetricFamily("deepinfer_spec_accepted_tokens", "accepted", labels=spec_labels)
        doc = "sequence-steps that verified a draft"
        verified = CounterMetricFamily("deepinfer_spec_verifications", doc, labels=spec_labels)
        for worker_id, handle in list(self.workers.items()):
            running.add_metric([worker_id], handle.core.num_running)
            waiting.add_metric([worker_id], handle.core.num_waiting)
            num_free, num_blocks = handle.core.block_manager.num_free_blocks, handle.core.limits.num_blocks
            free.add_metric([worker_id], num_free)
            usage.add_metric([worker_id], 1.0 - num_free / num_blocks if num_blocks else 0.0)
            speculator = handle.core.speculator
            for source, stats in speculator.stats.items():
                if source == speculator.method or stats.num_verified:  # a source in use, or used
                    where = [worker_id, source]
                    drafted.add_metric(where, stats.num_drafted)
                    accepted.add_metric(where, stats.num_accepted)
                    verified.add_metric(where, stats.num_verified)
        yield from (running, waiting, free, usage, drafted, accepted, verified)


def observe_queue_times(seqs: Mapping[str, Sequence], new_seq_ids: Iterable[str], now: float) -> None:
    """The queue time of each sequence a plan admits for the first time (``now``: monotonic), in
    the histogram and, for a traced request's first choice, as its ``scheduler.queue`` span."""
    for seq_id in new_seq_ids:
        seq = seqs.get(seq_id)
        if seq is not None and seq.queued_at:
            seconds = max(0.0, now - seq.queued_at)
            QUEUE_SECONDS.observe(seconds)
            if seq.traceparent and seq.index == 0:
                end_ns = time.time_ns()
                span = tracer().start_span(
                    "scheduler.queue",
                    context=parent_context(seq.traceparent),
                    start_time=end_ns - int(seconds * 1e9),
                    attributes={"deepinfer.request_id": seq.request_id},
                )
                span.end(end_time=end_ns)
            seq.queued_at = 0.0


def registry(workers: Mapping[str, WorkerHandle]) -> CollectorRegistry:
    """What /metrics shows: this process's events and the queues of ``workers`` (the service's)."""
    view = CollectorRegistry()
    view.register(EVENTS)
    view.register(QueueCollector(workers))
    return view
