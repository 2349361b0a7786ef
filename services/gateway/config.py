"""Gateway configuration: one frozen Config, built once in main()."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from libs.recipe.chat_formats import FORMATS


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
    chat_format: str = field(
        default="template",
        metadata={
            "help": "how prompts are written: template (the model's own) | deepseek-v4 | deepseek-v4.1"
        },
    )
    max_model_len: int = field(default=0, metadata={"help": "context window (0: the model's)"})
    grammar_backend: str = field(
        default="xgrammar",
        metadata={"help": "structured-output grammar backend: xgrammar | outlines (outlines-core)"},
    )
    submit_timeout_s: float = field(
        default=5.0, metadata={"help": "how long a submit may wait for a scheduler"}
    )
    retry_after_s: int = field(
        default=1, metadata={"help": "Retry-After seconds sent with a 429 when the scheduler's queue is full"}
    )
    resume_grace_s: float = field(
        default=10.0,
        metadata={"help": "how long a streaming request outlives its client's disconnect, for a resume"},
    )
    keepalive_s: float = field(
        default=15.0, metadata={"help": "longest silence on an SSE stream before a keep-alive comment"}
    )
    stream_retention_s: float = field(
        default=600.0, metadata={"help": "how long step outputs stay replayable (stream resume)"}
    )
    responses_ttl_s: float = field(
        default=30 * 86400.0, metadata={"help": "how long stored Responses API objects are kept"}
    )
    log_level: str = field(default="info", metadata={"help": "logging level"})

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.chat_format not in FORMATS:
            raise ValueError(f"chat_format must be one of {', '.join(FORMATS)}, got {self.chat_format!r}")
        if self.grammar_backend not in ("xgrammar", "outlines"):
            raise ValueError(f"grammar_backend must be xgrammar or outlines, got {self.grammar_backend!r}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if self.submit_timeout_s <= 0:
            raise ValueError(f"submit_timeout_s must be > 0, got {self.submit_timeout_s}")
        if self.resume_grace_s < 0:
            raise ValueError(f"resume_grace_s must be >= 0, got {self.resume_grace_s}")
        if self.stream_retention_s <= 0 or self.responses_ttl_s <= 0 or self.keepalive_s <= 0:
            raise ValueError("stream_retention_s, responses_ttl_s and keepalive_s must be > 0")
        if self.retry_after_s < 1:
            raise ValueError(f"retry_after_s must be >= 1, got {self.retry_after_s}")
