"""Gateway configuration: one frozen Config, built once in main()."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Config:
    nats_url: str = field(default="nats://127.0.0.1:4222", metadata={"help": "NATS server URL"})
    subject_prefix: str = field(default="deepinfer", metadata={"help": "prefix of every subject"})
    gateway_id: str = field(
        default_factory=lambda: "gw-" + uuid.uuid4().hex[:8], metadata={"help": "unique id"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP listen address"})
    port: int = field(default=8000, metadata={"help": "HTTP listen port"})
    model: str = field(
        default="smollm2", metadata={"help": "'smollm2' (embedded) or a llama-family .gguf path"}
    )
    served_model_name: str = field(default="", metadata={"help": "model id clients use (default: file name)"})
    cache_dir: str = field(default="", metadata={"help": "tokenizer cache (default: user cache dir)"})
    max_model_len: int = field(default=0, metadata={"help": "context window (0: the model's)"})
    submit_timeout_s: float = field(
        default=5.0, metadata={"help": "how long a submit may wait for a scheduler"}
    )
    retry_after_s: int = field(
        default=1, metadata={"help": "Retry-After seconds sent with a 429 when the scheduler's queue is full"}
    )
    log_level: str = field(default="info", metadata={"help": "logging level"})

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if self.submit_timeout_s <= 0:
            raise ValueError(f"submit_timeout_s must be > 0, got {self.submit_timeout_s}")
        if self.retry_after_s < 1:
            raise ValueError(f"retry_after_s must be >= 1, got {self.retry_after_s}")
