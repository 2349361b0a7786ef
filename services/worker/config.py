"""Worker configuration: one frozen Config, built once in main()."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

from libs.bus.nats_auth import NatsConfig
from libs.grammar.sandbox import CompileLimits
from libs.kvstore.retention import DEFAULT_RETENTION_SPEC, RetentionPolicy, policy_from_config
from libs.protocol.messages import SPECULATIVE_METHODS

DEVICE = re.compile(r"cpu|(cuda|npu)(:\d+)?")


@dataclass(frozen=True, slots=True)
class Config(NatsConfig):
    subject_prefix: str = field(default="deepinfer", metadata={"help": "prefix of every subject"})
    worker_id: str = field(
        default_factory=lambda: "worker-" + uuid.uuid4().hex[:8], metadata={"help": "unique id"}
    )
    model: str = field(
        default="smollm2",
        metadata={
            "help": "'smollm2' (embedded), a llama .gguf, or an HF checkpoint directory (DeepSeek-V3 family)"
        },
    )
    cache_dir: str = field(default="", metadata={"help": "converted-weights cache (default: user cache dir)"})
    device: str = field(
        default="cpu",
        metadata={"help": "cpu, cuda[:N] (flashinfer when installed, else plain torch), npu[:N] (untested)"},
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "weights: auto (on a CPU, int8 with float32 activations where the CPU kernels build,"
            " else bfloat16 with bf16 math and float32 without; bfloat16 on accelerators) | bfloat16"
            " | float32 | int8 (weight-only, kept quantized; float32 activations where the CPU kernels"
            " build, else bfloat16) | int4 (bf16 activations)"
        },
    )
    max_num_seqs: int = field(default=32, metadata={"help": "sequences decoded together"})
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "ranks (processes, one device each) that one model is sharded over with "
            "torch.distributed (gloo on CPU, NCCL on CUDA); this process is rank 0, the others start "
            "here (and with --nnodes, on the other nodes)"
        },
    )
    expert_parallel: bool = field(
        default=False,
        metadata={"help": "MoE models: whole routed experts per rank instead of a slice of every expert"},
    )
    nnodes: int = field(default=1, metadata={"help": "nodes the ranks are spread over (equally)"})
    node_rank: int = field(
        default=0,
        metadata={"help": "this node's index: 0 runs rank 0 (the worker the bus sees), others only ranks"},
    )
    dist_init_addr: str = field(
        default="",
        metadata={"help": "host:port where rank 0 listens for the other ranks ('': a free loopback port)"},
    )
    speculative_method: str = field(
        default="none",
        metadata={
            "help": "speculative decoding: where drafts come from besides a request's own prediction "
            "(none | ngram: the sequence's own earlier tokens | suffix: ngram, then what followed the "
            "same tokens in other requests' outputs | mtp: the model's MTP module, which the worker then "
            "loads and runs after each forward; DeepSeek-V3 family); drafts are verified, so output is "
            "unchanged"
        },
    )
    deterministic: bool = field(
        default=False,
        metadata={
            "help": "a request's tokens do not depend on its batch mates, chunking or preemption "
            "(batch-invariant attention; bfloat16 on the CPU only, which --dtype auto then means; "
            "checked at start: refused otherwise)"
        },
    )
    cpu_kernels: bool = field(
        default=True,
        metadata={
            "help": "on the CPU, build (once, cached) and use the C++ kernels (int8 matmuls, decode attention"
            " and KV writes, fp32 norms, rotary and silu*mul); false: the plain torch paths"
        },
    )
    max_model_len: int = field(default=0, metadata={"help": "context window (0: the model's)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_cache_gb: float = field(default=2.0, metadata={"help": "memory for KV pages, GiB"})
    num_threads: int = field(default=0, metadata={"help": "torch threads (0: torch's default)"})
    one_thread_max_tokens: int = field(
        default=0,
        metadata={
            "help": "CPU: steps of at most this many tokens run their forward on one thread; 0: every "
            "step on --num-threads (the CPU kernels' threads claim small chunks of work, so one that "
            "another service preempts no longer holds the step). Off with --deterministic (a "
            "product's rounding changes with its number of threads)"
        },
    )
    load_interval_s: float = field(default=0.5, metadata={"help": "period of load reports while idle"})
    orphan_timeout_s: float = field(
        default=30.0, metadata={"help": "scheduler silence after which its sequences here are dropped"}
    )
    max_step_s: float = field(
        default=60.0,
        metadata={"help": "a step running longer is stuck: the worker's heartbeat says it cannot serve"},
    )
    role: str = field(
        default="both",
        metadata={
            "help": "prefill | decode | both: a prefill worker computes long prompts and hands them "
            "to a decode worker after the first token (through the shared store, --kv-store-path)"
        },
    )
    drain_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "on SIGTERM, how long the worker keeps serving its owner while it moves the sequences"
            " held here elsewhere (0: leave at once)"
        },
    )
    host_cache_gb: float = field(
        default=1.0, metadata={"help": "host memory for KV blocks (G2), GiB; 0 turns G2 off"}
    )
    kv_store_path: str = field(
        default="",
        metadata={
            "help": "shared KV block store directory (G3): '' = <cache dir>/kv-store, 'none' turns G3 off"
        },
    )
    media_path: str = field(
        default="",
        metadata={
            "help": "the media store (images and their encoder outputs), a directory the gateways,"
            " encoders and workers share: '' = <cache dir>/media"
        },
    )
    handoff_dir: str = field(
        default="",
        metadata={
            "help": "P/D handoffs' partial last prompt blocks, a directory the prefill and decode workers"
            " share: '' = <kv store>/.handoff (none with G3 off); host shared memory (/dev/shm/...) when"
            " they share a machine"
        },
    )
    handoff_max_age_s: float = field(
        default=600.0, metadata={"help": "a handoff file no worker loaded is deleted once this old"}
    )
    retention_classes: str = field(
        default=DEFAULT_RETENTION_SPEC,
        metadata={"help": "G3 retention classes, name=ttl[:priority],... (ttl: 90s, 30m, 12h, 3d)"},
    )
    default_retention_class: str = field(
        default="agent", metadata={"help": "class of saved blocks that name none, or an unknown one"}
    )
    kv_store_fsync: bool = field(
        default=False, metadata={"help": "fsync each G3 block file (survives power loss; slower)"}
    )
    grammar_compile_timeout_s: float = field(
        default=10.0,
        metadata={"help": "longest one grammar compile may run; its compiler process is then killed"},
    )
    grammar_compile_max_mb: int = field(
        default=2048, metadata={"help": "memory one grammar compile may take, MiB (its process is capped)"}
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

    def __post_init__(self) -> None:
        NatsConfig.__post_init__(self)  # (slots: no zero-argument super())
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if not DEVICE.fullmatch(self.device):
            raise ValueError(f"device={self.device!r}: expected cpu, cuda[:N] or npu[:N]")
        if self.dtype not in ("auto", "bfloat16", "float32", "int8", "int4"):
            raise ValueError(f"dtype={self.dtype!r}: expected auto, bfloat16, float32, int8 or int4")
        positive = (
            "max_num_seqs",
            "block_size",
            "kv_cache_gb",
            "load_interval_s",
            "orphan_timeout_s",
            "max_step_s",
            "handoff_max_age_s",
        )
        for key in positive:
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            methods = ", ".join(SPECULATIVE_METHODS)
            raise ValueError(f"speculative_method must be one of {methods}, got {self.speculative_method!r}")
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.max_model_len < 0 or self.num_threads < 0 or self.one_thread_max_tokens < 0:
            raise ValueError("max_model_len, num_threads and one_thread_max_tokens must be >= 0")
        if self.grammar_compile_timeout_s <= 0 or self.grammar_compile_max_mb <= 0:
            raise ValueError("grammar_compile_timeout_s and grammar_compile_max_mb must be > 0")
        if not self.host_cache_gb >= 0:
            raise ValueError(f"host_cache_gb must be >= 0, got {self.host_cache_gb}")
        self.retention_policy()  # errors name the key
        self._check_parallel()

    def _check_parallel(self) -> None:
        size, nodes = self.tensor_parallel_size, self.nnodes
        if size < 1 or nodes < 1 or size % nodes or not 0 <= self.node_rank < nodes:
            raise ValueError(
                f"tensor_parallel_size {size} over nnodes {nodes} (node_rank {self.node_rank}):"
                " need size >= 1, a whole number of ranks per node, 0 <= node_rank < nnodes"
            )
        if nodes > 1 and not re.fullmatch(r"[^\s:]+:\d+", self.dist_init_addr):
            raise ValueError("nnodes > 1 needs dist_init_addr host:port (where rank 0 listens)")
        if size > 1 and self.speculative_method == "mtp":
            raise ValueError("speculative_method mtp is not implemented with tensor_parallel_size > 1")
        if size > 1 and self.deterministic:
            raise ValueError(
                "deterministic is not checked with tensor_parallel_size > 1 (its probe runs one rank)"
            )

    def retention_policy(self) -> RetentionPolicy:
        return policy_from_config(self.retention_classes, self.default_retention_class)

    def grammar_limits(self) -> CompileLimits:
        return CompileLimits(self.grammar_compile_timeout_s, self.grammar_compile_max_mb)
