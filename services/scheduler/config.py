"""Scheduler configuration: one frozen Config, built once in main()."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from libs.bus.nats_auth import NatsConfig
from services.scheduler.spec_policy import POLICIES
from services.scheduler.speculation import METHODS


@dataclass(frozen=True, slots=True)
class Config(NatsConfig):
    subject_prefix: str = field(default="deepinfer", metadata={"help": "prefix of every subject"})
    scheduler_id: str = field(
        default_factory=lambda: "sched-" + uuid.uuid4().hex[:8], metadata={"help": "unique id"}
    )
    max_num_waiting: int = field(default=256, metadata={"help": "queued sequences per worker before 429"})
    max_num_batched_tokens: int = field(
        default=512, metadata={"help": "tokens computed per step; longer prompts are prefilled in chunks"}
    )
    overlap: bool = field(
        default=True,
        metadata={
            "help": "send step N+1 before result N arrives (overlap scheduling): the worker's next forward "
            "starts without waiting for the scheduler's round trip (on a 2-core CPU shared by every "
            "service: 1.1-1.2x tokens/s at one stream, 1.02x at 8); false: one plan in flight"
        },
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata={
            "help": "reuse the KV of full blocks of a prompt prefix already computed on the worker "
            "(salted per tenant); false computes every prompt from scratch"
        },
    )
    enable_kv_tiers: bool = field(
        default=True,
        metadata={
            "help": "also start prompts on blocks in the worker's host memory (G2) or the shared store "
            "(G3), and save full blocks there at the end of each prompt and each output (needs "
            "prefix caching); false keeps only the worker's device pages (G1)"
        },
    )
    speculative_method: str = field(
        default="none",
        metadata={
            "help": "speculative decoding: where drafts come from besides a request's own prediction "
            "(none | ngram: the sequence's own earlier tokens | suffix: ngram, then what followed the "
            "same tokens in other requests' outputs | mtp: what the worker's MTP module proposes after "
            "each step, one token; the worker needs the same flag); the worker verifies them, so output "
            "is unchanged"
        },
    )
    speculative_max_tokens: int = field(
        default=5,
        metadata={"help": "the most tokens drafted for a sequence per step (0: none, predictions included)"},
    )
    speculative_policy: str = field(
        default="adaptive",
        metadata={
            "help": "how much of each draft a step verifies: adaptive (the prefix that makes the most "
            "tokens per second, from measured acceptance and step times; none when it does not pay) "
            "| fixed (all of it)"
        },
    )
    kv_lookup_timeout_s: float = field(
        default=0.05,
        metadata={"help": "longest a submit waits for kvcache to say which prompt blocks G3 holds"},
    )
    kv_dump_timeout_s: float = field(
        default=1.0, metadata={"help": "longest a resync waits for a worker's dump of its host blocks"}
    )
    kv_events_interval_s: float = field(
        default=0.1,
        metadata={"help": "period of the G1 (device) KV events this scheduler publishes for the routers"},
    )
    kv_stats_interval_s: float = field(
        default=5.0, metadata={"help": "period of the KV cache stats this scheduler publishes"}
    )
    step_timeout_s: float = field(default=120.0, metadata={"help": "longest a worker step may take"})
    worker_timeout_s: float = field(
        default=10.0, metadata={"help": "heartbeat silence after which a worker is dead (its requests move)"}
    )
    routing: str = field(
        default="kv",
        metadata={
            "help": "how a new request picks its replica and worker: kv (the gateway's router: the "
            "most of its prompt cached in some worker's G1/G2, against load, over every replica) | "
            "round_robin (any replica, then its workers in turn: the baseline kv is measured against)"
        },
    )
    pd_min_uncached_tokens: int = field(
        default=1024,
        metadata={
            "help": "P/D: a prompt with at least this many tokens its decode worker would have to "
            "compute goes to a prefill worker (one started with --role prefill), if one is free"
        },
    )
    pd_max_prefill_queue: int = field(
        default=2, metadata={"help": "P/D: a prefill worker holding this many sequences is busy"}
    )
    handoff_timeout_s: float = field(
        default=2.0,
        metadata={
            "help": "P/D: a prefilled request waits for its blocks' writes while its prefill worker "
            "reports; silent this long (stalled or dead), or 10x this in all, its decode worker is "
            "given it with the blocks written so far (it computes the rest)"
        },
    )
    migration_limit: int = field(
        default=3,
        metadata={
            "help": "moves a request may make after the worker or scheduler holding it was lost "
            "(the scheduler moves it to another worker; the gateway resubmits it to another scheduler); "
            "at the next loss its stream ends with an error (0: never move, fail at once)"
        },
    )
    out_max_age_s: float = field(default=600.0, metadata={"help": "how long step outputs stay replayable"})
    pause_timeout_s: float = field(
        default=20.0,
        metadata={
            "help": "longest a request paused by its gateway (its stream's client left) waits for a resume "
            "before it is cancelled here, for a pause that does not say (its gateway cancels it first, "
            "after --resume-grace-s; this bound is for a gateway that died)"
        },
    )
    watchdog_s: float = field(
        default=60.0, metadata={"help": "exit when the event loop has been stuck this long (0: off)"}
    )
    metrics_port: int = field(
        default=0, metadata={"help": "port of this process's Prometheus /metrics (0: not served)"}
    )
    log_level: str = field(default="info", metadata={"help": "logging level"})
    otel_endpoint: str = field(
        default="",
        metadata={"help": "send OpenTelemetry traces over OTLP/HTTP here ('': $OTEL_EXPORTER_OTLP_ENDPOINT)"},
    )
    log_format: str = field(
        default="text",
        metadata={"help": "log lines as text or json (each with its request id where it has one)"},
    )

    @property
    def num_speculative_tokens(self) -> int:
        """Tokens a sequence may draft per step. A request's prediction drafts without a method."""
        return self.speculative_max_tokens

    def __post_init__(self) -> None:
        NatsConfig.__post_init__(self)  # (slots: no zero-argument super())
        if self.routing not in ("kv", "round_robin"):
            raise ValueError(f"routing must be kv or round_robin, got {self.routing!r}")
        if self.speculative_method not in METHODS:
            methods = ", ".join(METHODS)
            raise ValueError(f"speculative_method must be one of {methods}, got {self.speculative_method!r}")
        if self.speculative_policy not in POLICIES:
            policies = ", ".join(POLICIES)
            raise ValueError(f"speculative_policy must be one of {policies}, got {self.speculative_policy!r}")
        if not 0 <= self.speculative_max_tokens <= 64:
            raise ValueError(f"speculative_max_tokens must be in 0..64, got {self.speculative_max_tokens}")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        for key in (
            "max_num_waiting",
            "max_num_batched_tokens",
            "step_timeout_s",
            "worker_timeout_s",
            "out_max_age_s",
            "kv_lookup_timeout_s",
            "kv_dump_timeout_s",
            "kv_stats_interval_s",
            "kv_events_interval_s",
            "pause_timeout_s",
            "pd_min_uncached_tokens",
            "pd_max_prefill_queue",
            "handoff_timeout_s",
        ):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
