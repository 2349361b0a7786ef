"""Encoder service configuration: one frozen Config, built once in main()."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from libs.bus.nats_auth import NatsConfig


@dataclass(frozen=True, slots=True)
class Config(NatsConfig):
    subject_prefix: str = field(default="deepinfer", metadata={"help": "prefix of every subject"})
    encoder_id: str = field(
        default_factory=lambda: "encoder-" + uuid.uuid4().hex[:8], metadata={"help": "unique id"}
    )
    model: str = field(
        default="", metadata={"help": "the vision-language checkpoint directory (its vision tower runs here)"}
    )
    device: str = field(default="cpu", metadata={"help": "cpu or cuda[:N]: where the vision tower runs"})
    dtype: str = field(
        default="auto",
        metadata={"help": "the tower's dtype: auto (CPU: float32, GPU: bfloat16) | bfloat16 | float32"},
    )
    cache_dir: str = field(default="", metadata={"help": "cache dir (default: user cache dir)"})
    media_path: str = field(
        default="",
        metadata={
            "help": "the media store (images and their encoder outputs), a directory the gateways,"
            " encoders and workers share: '' = <cache dir>/media"
        },
    )
    encoder_cache_gb: float = field(
        default=4.0,
        metadata={"help": "the encoder cache's size limit (its outputs in the media store), GiB"},
    )
    encoder_cache_min_age_s: float = field(
        default=600.0,
        metadata={
            "help": "an output used within this long is never evicted (its request may not be"
            " prefilled yet), even over the budget"
        },
    )
    max_queued_requests: int = field(
        default=64, metadata={"help": "encode requests waiting at most; past it, busy (the client's 503)"}
    )
    max_batch_images: int = field(
        default=16, metadata={"help": "images encoded in one forward of the vision tower, at most"}
    )
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
