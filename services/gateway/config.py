"""Gateway configuration: one frozen Config, built once in main()."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

from libs.bus.nats_auth import NatsConfig
from libs.grammar.sandbox import CompileLimits
from libs.kvstore.retention import DEFAULT_RETENTION_SPEC, RetentionPolicy, policy_from_config
from libs.recipe.chat_formats import FORMATS
from services.gateway.economics import PriceList

_HEADER_NAME = re.compile(r"[A-Za-z0-9-]+")


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one request's images may be (``services/gateway/image_admission.py``)."""

    max_images: int = 8  # per request
    max_image_bytes: int = 20 << 20  # per image file
    max_image_pixels: int = 1 << 25  # per image, width x height (a decompression bomb is refused)
    url_hosts: frozenset[str] = frozenset()  # hosts images may be fetched from (none: no URLs)
    url_timeout_s: float = 10.0
    encode_timeout_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Config(NatsConfig):
    subject_prefix: str = field(default="deepinfer", metadata={"help": "prefix of every subject"})
    gateway_id: str = field(
        default_factory=lambda: "gw-" + uuid.uuid4().hex[:8], metadata={"help": "unique id"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP listen address"})
    port: int = field(default=8000, metadata={"help": "HTTP listen port"})
    model: str = field(
        default="smollm2",
        metadata={"help": "'smollm2' (embedded), a llama .gguf, or an HF checkpoint directory"},
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
    grammar_compile_timeout_s: float = field(
        default=10.0,
        metadata={"help": "longest one grammar compile may run; its compiler process is then killed"},
    )
    grammar_compile_max_mb: int = field(
        default=2048, metadata={"help": "memory one grammar compile may take, MiB (its process is capped)"}
    )
    submit_timeout_s: float = field(
        default=5.0, metadata={"help": "how long a submit may wait for a scheduler"}
    )
    media_path: str = field(
        default="",
        metadata={
            "help": "the media store (images and their encoder outputs), a directory the gateways,"
            " encoders and workers share: '' = <cache dir>/media"
        },
    )
    max_images_per_request: int = field(default=8, metadata={"help": "images one request may carry"})
    max_image_mb: float = field(default=20.0, metadata={"help": "size of one image file, MiB, at most"})
    max_image_pixels: int = field(
        default=1 << 25, metadata={"help": "width x height of one image, at most (decompression bombs)"}
    )
    image_url_hosts: str = field(
        default="",
        metadata={
            "help": "hosts image URLs may be fetched from, comma-separated, each host (any port) or"
            " host:port ('': none, only inline images; fetching any URL a client names lets it probe"
            " this network)"
        },
    )
    encode_timeout_s: float = field(
        default=60.0, metadata={"help": "how long a request's images may wait for an encoder"}
    )
    routing: str = field(
        default="kv",
        metadata={
            "help": "how a new request picks its replica and worker: kv (the gateway's router: the "
            "most of its prompt cached in some worker's G1/G2, against load, over every replica) | "
            "round_robin (any replica, then its workers in turn: the baseline kv is measured against)"
        },
    )
    router_cache_weight: float = field(
        default=1.0, metadata={"help": "router cost weight of the prompt share a worker would compute"}
    )
    router_load_weight: float = field(
        default=1.0, metadata={"help": "router cost weight of the share of a worker's slots taken"}
    )
    router_temperature: float = field(
        default=0.0,
        metadata={"help": "router softmax temperature over -cost (0: always the cheapest worker)"},
    )
    migration_limit: int = field(
        default=3,
        metadata={
            "help": "moves a request may make after the worker or scheduler holding it was lost "
            "(the scheduler moves it to another worker; the gateway resubmits it to another scheduler); "
            "at the next loss its stream ends with an error (0: never move, fail at once)"
        },
    )
    resubmit_window_s: float = field(
        default=10.0,
        metadata={
            "help": "how long the gateway looks for a scheduler to take a request whose scheduler "
            "was lost (after that, its stream ends with an error)"
        },
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
    # The next two share their flags with the kvcache config (and the worker's, which writes the
    # store): `deepinfer serve` has one namespace of flags, so names, types and defaults must match.
    retention_classes: str = field(
        default=DEFAULT_RETENTION_SPEC,
        metadata={"help": "KV retention classes, name=ttl[:priority],... (lower priority evicted first)"},
    )
    default_retention_class: str = field(
        default="agent", metadata={"help": "retention class of a request that names none"}
    )
    api_keys_file: str = field(
        default="",
        metadata={
            "help": "JSON file of API keys (SHA-256 each, with its tenant, rate limit and priority; "
            "`deepinfer api-key` adds one): every /v1 route then needs a key; reloaded on SIGHUP. "
            "'' = no keys (anyone who reaches the port may call it)"
        },
    )
    tenant_header: str = field(
        default="",
        metadata={
            "help": "take the KV-cache tenant from this trusted header (set by an authenticating "
            "proxy) instead of hashing the API key; '' = off"
        },
    )
    price_input_per_million: float = field(
        default=0.28, metadata={"help": "serving economics: dollars per million uncached input tokens"}
    )
    price_cached_input_per_million: float = field(
        default=0.28 / 50, metadata={"help": "serving economics: dollars per million cache-hit input tokens"}
    )
    price_output_per_million: float = field(
        default=0.42, metadata={"help": "serving economics: dollars per million output tokens"}
    )
    rental_per_device_hour: float = field(
        default=7.0, metadata={"help": "serving economics: dollars one device's rental costs an hour"}
    )
    watchdog_s: float = field(
        default=60.0, metadata={"help": "exit when the event loop has been stuck this long (0: off)"}
    )
    shutdown_grace_s: float = field(
        default=10.0, metadata={"help": "on SIGTERM, how long in-flight streams may take to finish"}
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

    def __post_init__(self) -> None:
        NatsConfig.__post_init__(self)  # (slots: no zero-argument super())
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.chat_format not in FORMATS:
            raise ValueError(f"chat_format must be one of {', '.join(FORMATS)}, got {self.chat_format!r}")
        if self.grammar_backend not in ("xgrammar", "outlines"):
            raise ValueError(f"grammar_backend must be xgrammar or outlines, got {self.grammar_backend!r}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if self.grammar_compile_timeout_s <= 0 or self.grammar_compile_max_mb <= 0:
            raise ValueError("grammar_compile_timeout_s and grammar_compile_max_mb must be > 0")
        if self.submit_timeout_s <= 0:
            raise ValueError(f"submit_timeout_s must be > 0, got {self.submit_timeout_s}")
        if self.max_images_per_request < 0 or min(self.max_image_mb, self.max_image_pixels) <= 0:
            raise ValueError("max_images_per_request must be >= 0, max_image_mb and max_image_pixels > 0")
        if self.encode_timeout_s <= 0:
            raise ValueError(f"encode_timeout_s must be > 0, got {self.encode_timeout_s}")
        if self.routing not in ("kv", "round_robin"):
            raise ValueError(f"routing must be kv or round_robin, got {self.routing!r}")
        if min(self.router_cache_weight, self.router_load_weight, self.router_temperature) < 0:
            raise ValueError("router_cache_weight, router_load_weight and router_temperature must be >= 0")
        if self.migration_limit < 0 or self.resubmit_window_s < 0:
            raise ValueError("migration_limit and resubmit_window_s must be >= 0")
        if self.resume_grace_s < 0:
            raise ValueError(f"resume_grace_s must be >= 0, got {self.resume_grace_s}")
        if self.stream_retention_s <= 0 or self.responses_ttl_s <= 0 or self.keepalive_s <= 0:
            raise ValueError("stream_retention_s, responses_ttl_s and keepalive_s must be > 0")
        if self.retry_after_s < 1:
            raise ValueError(f"retry_after_s must be >= 1, got {self.retry_after_s}")
        if self.tenant_header and not _HEADER_NAME.fullmatch(self.tenant_header):
            raise ValueError(f"tenant_header must be an HTTP header name, got {self.tenant_header!r}")
        self.prices  # noqa: B018  (a negative price fails at start)
        self.retention_policy  # noqa: B018  (built now: a bad spec fails at start, naming its key)

    @property
    def retention_policy(self) -> RetentionPolicy:
        return policy_from_config(self.retention_classes, self.default_retention_class)

    @property
    def prices(self) -> PriceList:
        return PriceList(
            self.price_input_per_million,
            self.price_cached_input_per_million,
            self.price_output_per_million,
            self.rental_per_device_hour,
        )

    @property
    def image_limits(self) -> ImageLimits:
        hosts = frozenset(h.strip().lower() for h in self.image_url_hosts.split(",") if h.strip())
        return ImageLimits(
            self.max_images_per_request,
            int(self.max_image_mb * (1 << 20)),
            self.max_image_pixels,
            hosts,
            encode_timeout_s=self.encode_timeout_s,
        )

    @property
    def grammar_limits(self) -> CompileLimits:
        return CompileLimits(self.grammar_compile_timeout_s, self.grammar_compile_max_mb)
