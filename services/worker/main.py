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
from libs.kvstore.media_store import MediaStore
from libs.modelfiles.registry import is_vision_model, model_fingerprint, resolve_model_path
from libs.models.deepseek_v3 import DeepseekV3ForCausalLM
from libs.models.llama import LlamaForCausalLM
from libs.models.sharding import Shard
from libs.protocol.member_messages import StepSample
from libs.recipe.grammar_markup import grammar_vocab_of
from libs.recipe.tokenizer import Tokenizer
from libs.runtime.logs import setup_logging
from libs.runtime.metrics_server import start_metrics_server
from libs.runtime.process import run_service
from libs.runtime.settings import build_config, kv_store_root, media_root, resolve_cache_dir
from services.worker import determinism, metrics
from services.worker.config import Config
from services.worker.forward_executor import ModelShape
from services.worker.grammar_compilers import DEFAULT_BACKEND, Grammars
from services.worker.handoff_area import HANDOFF_DIR_NAME, HandoffArea
from services.worker.host_cache import HostCache
from services.worker.image_inputs import ImageInputs
from services.worker.kv_cache import element_size
from services.worker.kv_store import KVStore, dtype_name, kv_fingerprint
from services.worker.kv_tiers import KVTiers
from services.worker.model_loading import (
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_format,
)
from services.worker.model_runner import ModelRunner
from services.worker.mtp_drafter import MTPDrafter
from services.worker.parallel_executor import ParallelExecutor, start_ranks
from services.worker.parallel_group import shard_executor, shard_shape
from services.worker.rank import follow_node
from services.worker.service import WorkerService
from services.worker.step_profile import profile_steps
from services.worker.warmup import warm_up

log = logging.getLogger(__name__)


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

    def close(self) -> None:
        """The other ranks (tensor parallel) and the grammar compiler processes stopped, for a
        worker built in a process that goes on (tests, benches)."""
        if isinstance(self.runner.executor, ParallelExecutor):
            self.runner.executor.stop()
        self.runner.grammars.close()


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
    vision = is_vision_model(path)
    if vision and config.tensor_parallel_size > 1:
        raise ValueError(f"{path}: a vision model runs on one rank (--tensor-parallel-size 1)")
    ranks = start_ranks(config, cache_dir, path, fmt, dtype) if config.tensor_parallel_size > 1 else None
    shard = Shard(ranks.tp, config.expert_parallel) if ranks is not None else None
    model = load_model(path, Path(cache_dir), fmt, device, with_mtp, shard)
    if config.deterministic:
        check_deterministic(model, device, dtype, config.speculative_method)
    shape = ModelShape.of(model.config)
    # Rank 0 holds the most KV heads of any rank (split_evenly): its pages size every rank's pool.
    local_shape = shard_shape(shape, model.config, shard) if shard is not None else shape
    num_blocks = kv_pool_blocks(config, local_shape.kv_spec, dtype, with_mtp)
    log.info(
        "model %s (%s KV) dtype=%s, %d KV blocks of %d tokens%s",
        path.name,
        shape.kv_spec.kind,
        dtype,
        num_blocks,
        config.block_size,
        f" per rank, over {config.tensor_parallel_size} ranks" if shard is not None else "",
    )
    grammars = Grammars(
        grammar_vocab(path, Path(cache_dir), model.config.vocab_size), limits=config.grammar_limits()
    )
    # The gateway's default, or the other backend (with a warning) where it does not import; the
    # other one starts on its first request. Neither importing: a broken install, no start.
    grammars.warm(resolve_backend(DEFAULT_BACKEND))
    weights = fmt if fmt in ("int8", "int4") else dtype_name(dtype)
    rank_layout = shard.layout(model.config) if shard is not None else None
    fingerprint = kv_fingerprint(
        path, weights, dtype, shape.kv_spec, rank_layout.describe() if rank_layout else ""
    )
    executor = None
    if ranks is not None and rank_layout is not None:
        local = shard_executor(
            model, local_shape, num_blocks, config.block_size, dtype, device, config.one_thread_max_tokens
        )
        executor = ranks.drive(local, shape.kv_spec, rank_layout)
    runner = ModelRunner(
        model,
        shape,
        num_blocks,
        config.block_size,
        dtype,
        device,
        grammars=grammars,
        kv_tiers=build_kv_tiers(config, cache_dir, fingerprint, shape.kv_spec, dtype),
        handoff=build_handoff_area(config, cache_dir, fingerprint, shape.kv_spec, dtype),
        drafter=mtp_drafter(model, num_blocks, config.block_size, dtype, device) if with_mtp else None,
        batch_invariant=config.deterministic,
        one_thread_max_tokens=config.one_thread_max_tokens if device.type == "cpu" else 0,
        executor=executor,
        images=image_inputs(config, cache_dir, path, model.config.hidden_size, dtype, device)
        if vision
        else None,
    )
    # Before the worker announces itself: its owner's speculative policy starts from these
    # times. (The warm-up runs later, on the thread that will run the forwards: serve.)
    step_profile = profile_steps(runner, config.max_num_seqs) if profile else ()
    return Worker(runner, max_model_len(config, model), path.name.split(".")[0], fingerprint, step_profile)


def image_inputs(
    config: Config, cache_dir: str, path: Path, hidden_size: int, dtype: torch.dtype, device: torch.device
) -> ImageInputs:
    """Where a vision model's image embeddings come from: the encoders' outputs in the media store,
    under the checkpoint's fingerprint (the one the gateway asks the encoders for)."""
    store = MediaStore(media_root(config.media_path, cache_dir))
    log.info("images: encoder outputs from the media store %s", store.root)
    return ImageInputs(store, model_fingerprint(path), hidden_size, dtype, device)


def max_model_len(config: Config, model: LlamaForCausalLM | DeepseekV3ForCausalLM) -> int:
    """--max-model-len, or the model's positions if it has fewer (or none was given)."""
    num_positions = model.config.max_position_embeddings
    if config.max_model_len > num_positions:
        log.warning(
            "--max-model-len %d: the model has %d positions; using that", config.max_model_len, num_positions
        )
    return min(config.max_model_len or num_positions, num_positions)


def mtp_drafter(
    model: LlamaForCausalLM | DeepseekV3ForCausalLM,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> MTPDrafter:
    assert isinstance(model, DeepseekV3ForCausalLM)  # load_model refused anything else
    log.info("drafting with the model's MTP module (its own latent pages, same block ids)")
    return MTPDrafter(model, num_blocks, block_size, dtype, device)


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
    service: WorkerService | None = None
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
        if isinstance(worker.runner.executor, ParallelExecutor):  # the other ranks exit
            if service is not None:
                await service.close_step_thread()  # after the last forward
            await asyncio.to_thread(worker.runner.executor.stop)


def main(args: argparse.Namespace) -> None:
    config = build_config(Config, args, os.environ)
    cache_dir = resolve_cache_dir(config.cache_dir, os.environ)
    setup_logging(config.log_level, "worker", config.log_format)
    if config.node_rank > 0:  # only ranks here: rank 0, the worker the bus sees, is on node 0
        follow_node(config)
        return
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    run_service(lambda stop: serve(config, cache_dir, stop), config.watchdog_s, config.max_step_s)
