"""Worker process: ``deepinfer worker --nats-url URL [--model M] [--dtype D]``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from libs.bus.nats_bus import NatsBus
from libs.grammar import resolve_backend
from libs.kernels import cpu_ext
from libs.kvstore.block_file import BlockLayout
from libs.kvstore.kv_spec import KVSpec
from libs.modelfiles.registry import model_architecture, resolve_model_path
from libs.models.deepseek_loader import load_deepseek_v3
from libs.models.deepseek_v3 import DeepseekV3ForCausalLM
from libs.models.gguf_loader import load_llama
from libs.models.llama import LlamaForCausalLM
from libs.models.quant import quantize_model
from libs.models.sharding import Shard, parallelize, shard_model
from libs.protocol.member_messages import StepSample
from libs.recipe.grammar_markup import grammar_vocab_of
from libs.recipe.tokenizer import Tokenizer
from libs.runtime.logs import setup_logging
from libs.runtime.metrics_server import start_metrics_server
from libs.runtime.process import run_service
from libs.runtime.settings import build_config, kv_store_root, resolve_cache_dir
from services.worker import determinism, metrics
from services.worker.config import Config
from services.worker.forward_executor import ForwardExecutor, ModelShape
from services.worker.grammar_compilers import DEFAULT_BACKEND, Grammars
from services.worker.handoff_area import HANDOFF_DIR_NAME, HandoffArea
from services.worker.host_cache import HostCache
from services.worker.kv_cache import element_size
from services.worker.kv_store import KVStore, dtype_name, kv_fingerprint
from services.worker.kv_tiers import KVTiers
from services.worker.model_runner import ModelRunner
from services.worker.mtp_drafter import MTPDrafter
from services.worker.parallel_executor import ParallelExecutor, shard_shape, start_rank_group
from services.worker.service import WorkerService
from services.worker.step_profile import profile_steps
from services.worker.warmup import warm_up

log = logging.getLogger(__name__)
CPU = torch.device("cpu")


def resolve_device(name: str) -> torch.device:
    """The worker's device, refused at start when this torch cannot use it (naming what is missing)."""
    if name.startswith("npu"):
        try:
            import torch_npu  # type: ignore[import-not-found]  # noqa: F401  (registers the npu device)
        except ImportError:
            raise ValueError(f"--device {name}: needs torch_npu (Ascend), which is not installed") from None
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this torch sees no CUDA device (torch {torch.__version__})")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_dtype(name: str, device: torch.device = CPU) -> torch.dtype:
    """The activation and KV dtype. auto: bf16 on an accelerator, and on a CPU with native bf16 math
    (AVX-512 BF16 / AMX), else fp32. int8 weights run with the same activations as auto (fp32 ones
    through the CPU extension's kernel); int4 weights with bf16 (torch's int4 kernel wants them).
    Both are CPU kernels."""
    if name in ("int8", "int4") and device.type != "cpu":
        raise ValueError(f"--dtype {name}: weight-only int8/int4 are CPU kernels; use bfloat16 on {device}")
    if name == "auto":
        bf16_math = device.type != "cpu" or torch.cpu._is_avx512_bf16_supported()
        return torch.bfloat16 if bf16_math else torch.float32
    if name == "int8":
        # fp32 int8 needs the extension's kernel: without it, torch's bf16 one is the faster route
        return torch.float32 if cpu_ext.ops() is not None else torch.bfloat16
    if name == "int4":
        return torch.bfloat16
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def resolve_format(
    name: str, device: torch.device = CPU, dense_only: bool = False, deterministic: bool = False
) -> str:
    """The weight format ``--dtype name`` loads: auto is int8 (with fp32 activations) on a CPU
    where the CPU kernels are built. Decode at a few rows reads every weight once a step, and int8
    halves bf16's bytes: at one row it decodes 3.7x as fast as fp32 on an AVX2 CPU and 1.7x as
    fast as bf16 on an AVX-512 BF16 one, and agrees with fp32's top-1 wherever fp32's top-2 margin
    is >= 0.5, as bf16 does (bench/weight_formats.py, bench/vs_llama_server.py). Elsewhere, and for
    models the int8 layers do not cover (``dense_only``: DeepSeek checkpoints, MTP drafting), auto
    is the activation dtype; with ``deterministic``, bf16 (batch invariance holds there only:
    determinism.py)."""
    if name != "auto":
        return name
    if deterministic:
        return "bfloat16"
    if device.type == "cpu" and not dense_only and cpu_ext.ops() is not None:
        return "int8"
    return dtype_name(resolve_dtype("auto", device))


# HF config.json architectures served from a checkpoint directory (GGUF files: llama).
# (V3.2 is the same model plus a sparse-attention indexer, which is not implemented here.)
DEEPSEEK_ARCHITECTURES = ("DeepseekV3ForCausalLM",)


def load_model(
    path: Path,
    cache_dir: Path,
    fmt: str,
    device: torch.device = CPU,
    with_mtp: bool = False,
    shard: Shard | None = None,
) -> LlamaForCausalLM | DeepseekV3ForCausalLM:
    """The model in weight format ``fmt`` (a --dtype value) on ``device``; activations in
    ``resolve_dtype(fmt, device)``. Found by architecture; one this worker cannot run is refused,
    naming the file and field. ``with_mtp``: with its MTP module, to draft with (DeepSeek-V3
    family); otherwise that stays on disk (V3's is 11.5B parameters). ``shard``: this rank's
    part of a tensor-parallel model (each rank reads the whole file, then keeps its part)."""
    model = _load_whole(path, cache_dir, fmt, device, with_mtp, shard)
    if shard is not None:
        parallelize(model, shard.tp)
    return model


def _load_whole(
    path: Path, cache_dir: Path, fmt: str, device: torch.device, with_mtp: bool, shard: Shard | None
) -> LlamaForCausalLM | DeepseekV3ForCausalLM:
    dtype = resolve_dtype(fmt, device)
    architecture = model_architecture(path)
    if path.is_dir():
        if architecture not in DEEPSEEK_ARCHITECTURES:
            raise ValueError(
                f"{path / 'config.json'}: architectures {architecture!r} is not served from a checkpoint "
                f"directory (supported: {', '.join(DEEPSEEK_ARCHITECTURES)}; llama as GGUF)"
            )
        if fmt in ("int8", "int4"):
            raise ValueError(f"--dtype {fmt}: weight-only int8/int4 is implemented for llama only")
        deepseek = load_deepseek_v3(path, dtype, device, with_mtp=with_mtp)
        if shard is not None:
            shard_model(deepseek, shard)
        return deepseek
    if with_mtp:
        raise ValueError(f"{path}: --speculative-method mtp needs a DeepSeek-V3-family checkpoint")
    if architecture != "llama":
        raise ValueError(f"{path}: general.architecture {architecture!r} is not supported (llama)")
    return load_llama_model(path, cache_dir, fmt, device, shard)


def load_llama_model(
    path: Path, cache_dir: Path, fmt: str, device: torch.device = CPU, shard: Shard | None = None
) -> LlamaForCausalLM:
    """A llama GGUF in weight format ``fmt`` on ``device`` (``shard``: this rank's part, quantized
    after it is cut, before its collectives are installed)."""
    dtype = resolve_dtype(fmt, device)
    model = load_llama(path, cache_dir, dtype=dtype, device=device)
    if shard is not None:
        shard_model(model, shard)
    if fmt in ("int8", "int4"):
        quantize_model(model, fmt)  # weight-only: projections and LM head stay packed
        log.info("weights quantized to %s (activations %s)", fmt, dtype)
    return model


def grammar_vocab(path: Path, cache_dir: Path, vocab_size: int) -> list[bytes]:
    """The bytes of each token id as grammars see them (``libs.grammar.grammar_vocab``)."""
    tokenizer = Tokenizer.from_hf_dir(path) if path.is_dir() else Tokenizer.from_gguf(path, cache_dir)
    return grammar_vocab_of(tokenizer, vocab_size)


def build_kv_tiers(
    config: Config, cache_dir: str, fingerprint: str, kv_spec: KVSpec, dtype: torch.dtype
) -> KVTiers | None:
    """G2 sized by ``host_cache_gb`` and G3 at ``kv_store_path``; None when both are off."""
    host = None
    block_bytes = kv_spec.bytes_per_block(config.block_size, element_size(dtype))
    num_host_blocks = int(config.host_cache_gb * 2**30) // block_bytes
    if num_host_blocks > 0:
        pin = torch.device(config.device).type == "cuda"  # pinned: full-bandwidth copies to the GPU
        host = HostCache(num_host_blocks, kv_spec.block_shape(config.block_size), dtype, pin_memory=pin)
    root = kv_store_root(config.kv_store_path, cache_dir)
    store = None
    if root is not None:
        block_layout = BlockLayout(kv_spec, config.block_size)
        policy = config.retention_policy()
        store = KVStore(root, fingerprint, block_layout, dtype, policy, fsync=config.kv_store_fsync)
    log.info("KV tiers: G2 %d blocks, G3 %s (fingerprint %s)", num_host_blocks, root or "off", fingerprint)
    return KVTiers(host, store) if host is not None or store is not None else None


def build_handoff_area(
    config: Config, cache_dir: str, fingerprint: str, kv_spec: KVSpec, dtype: torch.dtype
) -> HandoffArea | None:
    """The handoff area at ``handoff_dir``, else under the G3 store; None when neither is set."""
    store_root = kv_store_root(config.kv_store_path, cache_dir)
    root = Path(config.handoff_dir).expanduser() if config.handoff_dir else None
    if root is None and store_root is not None:
        root = store_root / HANDOFF_DIR_NAME
    if root is None:
        return None
    block_layout = BlockLayout(kv_spec, config.block_size)
    log.info("P/D handoff area: %s", root)
    return HandoffArea(root, fingerprint, block_layout, dtype, max_age_s=config.handoff_max_age_s)


def check_deterministic(
    model: LlamaForCausalLM | DeepseekV3ForCausalLM, device: torch.device, dtype: torch.dtype, method: str
) -> None:
    """Raise ValueError, with the reason, where --deterministic cannot hold (worker/determinism.py)."""
    reason = determinism.refusal(device, dtype, model.config.kv_spec(), method)
    if reason is None and isinstance(model, LlamaForCausalLM):
        reason = determinism.probe(model, dtype)
    elif reason is None:
        reason = f"{type(model).__name__} is not checked for batch invariance"
    if reason is not None:
        raise ValueError(f"--deterministic: {reason}")
    log.info("deterministic: batch-invariant attention; the projections passed the batch-invariance probe")


@dataclass(frozen=True, slots=True)
class Worker:
    runner: ModelRunner
    max_model_len: int
    model_name: str
    fingerprint: str  # identity of the KV it computes, for block hashes and G3 paths
    step_profile: tuple[StepSample, ...]  # steps timed at start (its owner's speculative policy)


def build_worker(config: Config, cache_dir: str, profile: bool = True) -> Worker:
    """Load the model (this rank's shard of it, with --tensor-parallel-size; the other ranks start
    here), size the KV pool and the KV tiers, and (``profile``) time a few steps."""
    path = resolve_model_path(config.model)
    device = resolve_device(config.device)
    if device.type == "cpu":  # built (or loaded from the cache) now, before the worker announces itself
        cpu_ext.configure(config.cpu_kernels, Path(cache_dir) / "kernels")
    with_mtp = config.speculative_method == "mtp"
    fmt = resolve_format(config.dtype, device, path.is_dir() or with_mtp, config.deterministic)
    dtype = resolve_dtype(fmt, device)
    if fmt == "int8" and dtype == torch.float32 and cpu_ext.ops() is None:
        log.warning("--dtype int8 with fp32 activations and no CPU kernels: its matmuls dequantize, slowly")
    group = start_rank_group(config, cache_dir, path, fmt) if config.tensor_parallel_size > 1 else None
    shard = Shard(group.tp, config.expert_parallel) if group is not None else None
    model = load_model(path, Path(cache_dir), fmt, device, with_mtp, shard)
    if config.deterministic:
        check_deterministic(model, device, dtype, config.speculative_method)
    num_positions = model.config.max_position_embeddings
    max_model_len = min(config.max_model_len or num_positions, num_positions)
    if config.max_model_len > num_positions:
        log.warning(
            "--max-model-len %d: the model has %d positions; using that", config.max_model_len, num_positions
        )
    shape = ModelShape.of(model.config)
    # Rank 0 holds the most KV heads of any rank (split_evenly): its pages set the pool's size.
    local_shape = shard_shape(shape, model.config, shard) if shard is not None else shape
    num_blocks = kv_pool_blocks(config, local_shape.kv_spec, dtype, with_mtp)
    log.info(
        "model %s (%s KV) dtype=%s, %d KV blocks of %d tokens%s",
        path.name,
        shape.kv_spec.kind,
        dtype,
        num_blocks,
        config.block_size,
        f", tensor parallel over {config.tensor_parallel_size} ranks" if shard is not None else "",
    )
    grammars = Grammars(
        grammar_vocab(path, Path(cache_dir), model.config.vocab_size), limits=config.grammar_limits()
    )
    # The gateway's default, or the other backend (with a warning) where it does not import; the
    # other one starts on its first request. Neither importing: a broken install, no start.
    grammars.warm(resolve_backend(DEFAULT_BACKEND))
    weights = fmt if fmt in ("int8", "int4") else dtype_name(dtype)
    layout = shard.layout(model.config).describe() if shard is not None else ""
    fingerprint = kv_fingerprint(path, weights, dtype, shape.kv_spec, layout)
    kv_tiers = build_kv_tiers(config, cache_dir, fingerprint, shape.kv_spec, dtype)
    handoff = build_handoff_area(config, cache_dir, fingerprint, shape.kv_spec, dtype)
    drafter = None
    if with_mtp:
        assert isinstance(model, DeepseekV3ForCausalLM)  # load_model refused anything else
        drafter = MTPDrafter(model, num_blocks, config.block_size, dtype, device)
        log.info("drafting with the model's MTP module (its own latent pages, same block ids)")
    executor = None
    if group is not None and shard is not None:
        local = ForwardExecutor(
            model,
            local_shape,
            num_blocks,
            config.block_size,
            dtype,
            device,
            fuse_blocks=False,
            one_thread_max_tokens=config.one_thread_max_tokens if device.type == "cpu" else 0,
        )
        executor = group.executor(local, shape.kv_spec, shard.layout(model.config))
    runner = ModelRunner(
        model,
        shape,
        num_blocks,
        config.block_size,
        dtype,
        device,
        grammars=grammars,
        kv_tiers=kv_tiers,
        handoff=handoff,
        drafter=drafter,
        batch_invariant=config.deterministic,
        one_thread_max_tokens=config.one_thread_max_tokens if device.type == "cpu" else 0,
        executor=executor,
    )
    # Before the worker announces itself: its owner's speculative policy starts from these
    # times. (The warm-up runs later, on the thread that will run the forwards: serve.)
    step_profile = profile_steps(runner, config.max_num_seqs) if profile else ()
    return Worker(runner, max_model_len, path.name.split(".")[0], fingerprint, step_profile)


def kv_pool_blocks(config: Config, kv_spec: KVSpec, dtype: torch.dtype, with_mtp: bool) -> int:
    """KV pages of ``block_size`` tokens in ``kv_cache_gb`` (per rank), the MTP module's included."""
    kv_bytes_per_token = kv_spec.bytes_per_token(element_size(dtype))
    drafter_bytes_per_token = 0  # the MTP module's latent pages share the block ids
    if with_mtp:
        drafter_bytes_per_token = kv_bytes_per_token // kv_spec.num_layers
    pool_bytes = int(config.kv_cache_gb * 2**30)
    return pool_bytes // ((kv_bytes_per_token + drafter_bytes_per_token) * config.block_size)


def build_runner(config: Config, cache_dir: str) -> tuple[ModelRunner, int, str]:
    """``build_worker`` as (runner, max_model_len, model name), for the benchmarks: no step
    profile (they warm the shapes they time themselves and draft nothing)."""
    worker = build_worker(config, cache_dir, profile=False)
    return worker.runner, worker.max_model_len, worker.model_name


async def serve(config: Config, cache_dir: str, stop: asyncio.Event) -> None:
    worker = await asyncio.to_thread(build_worker, config, cache_dir)
    bus = await NatsBus.connect(config.nats_url, name=config.worker_id, auth=config.nats_auth)
    try:
        service = WorkerService(
            config,
            bus,
            worker.runner,
            worker.max_model_len,
            worker.model_name,
            worker.fingerprint,
            worker.step_profile,
        )
        start_metrics_server(config.metrics_port, metrics.registry(worker.runner))
        # The shapes a first request takes, warm on the forward thread itself: OpenMP's teams and
        # the math libraries' per-thread state belong to the thread that calls them.
        await service.on_step_thread(warm_up)
        # ... and the grammar compiler processes ready (started in build_worker, they warmed
        # meanwhile): still starting, they would take the cores from the first requests. A stop
        # is not held up by them (closing the grammars below ends the wait's thread).
        warming = asyncio.ensure_future(asyncio.to_thread(worker.runner.grammars.wait_warm))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({warming, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not stop.is_set():
            await service.run(stop)
    finally:
        await bus.close()
        if worker.runner.kv_tiers is not None:
            await asyncio.to_thread(worker.runner.kv_tiers.close)  # the queued G3 writes finish
        if worker.runner.transfer.handoff is not None:
            await asyncio.to_thread(worker.runner.transfer.handoff.close)
        worker.runner.grammars.close()  # kills the grammar compiler processes
        if isinstance(worker.runner.executor, ParallelExecutor):
            worker.runner.executor.stop()  # the other ranks exit


def main(args: argparse.Namespace) -> None:
    config = build_config(Config, args, os.environ)
    cache_dir = resolve_cache_dir(config.cache_dir, os.environ)
    setup_logging(config.log_level, "worker", config.log_format)
    if config.node_rank > 0:  # only ranks here: rank 0, the worker the bus sees, is on node 0
        from services.worker.rank import follow_node  # (imports this module)

        follow_node(config)
        return
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    run_service(lambda stop: serve(config, cache_dir, stop), config.watchdog_s, config.max_step_s)
