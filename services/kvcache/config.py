"""KV-cache service configuration: one frozen Config, built once in main().

``kv_store_path``, ``retention_classes`` and ``default_retention_class`` mean the same to the worker
(which writes the store) and to this service (which indexes and trims it); ``deepinfer serve``
gives both processes the same flag, and both read it with ``libs.runtime.settings.kv_store_root``, so
they cannot disagree ("none": G3 is off for both).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from libs.bus.nats_auth import NatsConfig
from libs.kvstore.retention import DEFAULT_RETENTION_SPEC, RetentionPolicy, policy_from_config

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Config(NatsConfig):
    subject_prefix: str = field(default="deepinfer", metadata={"help": "prefix of every subject"})
    kvcache_id: str = field(
        default_factory=lambda: "kvcache-" + uuid.uuid4().hex[:8], metadata={"help": "unique id"}
    )
    cache_dir: str = field(default="", metadata={"help": "cache dir (default: user cache dir)"})
    kv_store_path: str = field(
        default="",
        metadata={
            "help": "the shared G3 store, one file per KV block: '' = <cache dir>/kv-store, 'none' = off"
        },
    )
    retention_classes: str = field(
        default=DEFAULT_RETENTION_SPEC,
        metadata={"help": "stored-KV retention classes: name=ttl[:priority],... (lower priority goes first)"},
    )
    default_retention_class: str = field(
        default="agent", metadata={"help": "class of stored KV whose request names none"}
    )
    store_capacity_gb: float = field(default=50.0, metadata={"help": "the G3 store's size limit, GiB"})
    gc_interval_s: float = field(
        default=60.0, metadata={"help": "period of the store's expiry and eviction pass (no scan)"}
    )
    reconcile_interval_s: float = field(
        default=3600.0,
        metadata={"help": "period of the full pass: scan every file (index == store), then snapshot"},
    )
    stats_interval_s: float = field(default=5.0, metadata={"help": "period of the kvcache stats"})
    watchdog_s: float = field(
        default=60.0, metadata={"help": "exit when the event loop has been stuck this long (0: off)"}
    )
    metrics_port: int = field(
        default=0, metadata={"help": "port of this process's Prometheus /metrics (0: not served)"}
    )
    log_level: str = field(default="info", metadata={"help": "logging level"})
    log_format: str = field(
        default="text",
        metadata={"help": "log lines as text or json (each with its request id where it has one)"},
    )

    def __post_init__(self) -> None:
        NatsConfig.__post_init__(self)  # (slots: no zero-argument super())
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        for key in ("store_capacity_gb", "gc_interval_s", "reconcile_interval_s", "stats_interval_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
        self.retention_policy  # noqa: B018  (built now: a bad spec fails at start, naming its key)

    @property
    def retention_policy(self) -> RetentionPolicy:
        return policy_from_config(self.retention_classes, self.default_retention_class)

    @property
    def store_capacity_bytes(self) -> int:
        return int(self.store_capacity_gb * GIB)
