"""Rank 0's forward executor for a tensor-parallel worker: each forward and each KV move is first
told to the other ranks, then done here on rank 0's shard, so every rank runs the same
collectives in the same order.

The step driver (ModelRunner) sees the same executor as with one rank: ``forward`` gives the
whole vocabulary's logits (the LM head gathers them here), and ``kv_cache`` moves whole pages,
every rank's heads (``ShardedKVCache``), so G2, G3 and P/D handoffs hold the layout of one rank.

Failure is the worker's: a forward that raises here may have left the other ranks inside a
collective this rank never reached, and the next forward's collectives would then pair with the
wrong ones. So the worker exits (``leave``) rather than rerun rows, as it does when a rank dies,
and its sequences move to other workers as a dead worker's do.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from libs.kvstore.kv_spec import KVSpec
from libs.modelfiles.gguf_metadata import read_gguf_config
from libs.models import shm_all_reduce
from libs.models.deepseek_loader import config_of
from libs.models.parallel import TPGroup
from libs.models.sharding import RankLayout
from services.worker.config import Config
from services.worker.forward_executor import ForwardBatch, ForwardExecutor
from services.worker.kv_cache import KVCache, element_size
from services.worker.kv_store import dtype_name
from services.worker.parallel_group import (
    Allocate,
    GatherBlocks,
    RankChannel,
    RankSetup,
    ScatterBlocks,
    Stop,
    free_address,
    gather_kv,
    join_group,
    open_shm,
    release,
    scatter_kv,
    spawn_ranks,
)

log = logging.getLogger(__name__)

RANK_LOST_EXIT_CODE = 71  # the worker left because its group broke (a rank died or a forward raised)


def leave(reason: str) -> None:
    """Exit the worker now: its ranks are out of step, so nothing more can run (no cleanup: a
    drain would run forwards). Local ranks exit with it (their pipe from it closes)."""
    log.critical("tensor-parallel group broken (%s): the worker exits; its sequences move elsewhere", reason)
    logging.shutdown()
    os._exit(RANK_LOST_EXIT_CODE)


class ShardedKVCache:
    """Rank 0's view of every rank's pages: a block moves whole (every rank's heads)."""

    def __init__(
        self, local: KVCache, full_spec: KVSpec, channel: RankChannel, tp: TPGroup, layout: RankLayout
    ) -> None:
        self.local = local
        self.kv_spec = full_spec
        self.channel = channel
        self.tp = tp
        self.layout = layout
        self.num_blocks = local.num_blocks
        self.block_size = local.block_size
        self.dtype = local.dtype
        # What every rank's pages cost per token together (MLA: each rank caches the whole latent).
        copies = tp.size if local.kv_spec == full_spec else 1
        self.bytes_per_token = full_spec.bytes_per_token(element_size(local.dtype)) * copies

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return self.kv_spec.block_shape(self.block_size)

    def gather_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        try:
            if self.local.kv_spec != self.kv_spec:  # split heads: every rank sends its own
                self.channel.send(GatherBlocks(tuple(block_ids)))
            return gather_kv(self.tp, self.layout, self.local, block_ids)
        except Exception as e:  # the ranks may be inside the move: nothing can pair with them now
            leave(f"a KV gather failed: {e}")
            raise  # (not reached)

    def scatter_blocks(self, block_ids: Sequence[int], payload: torch.Tensor) -> None:
        if payload.shape != (len(block_ids), *self.block_shape) or payload.dtype != self.dtype:
            raise ValueError(f"payload {tuple(payload.shape)} {payload.dtype} does not fit these pages")
        try:
            self.channel.send(ScatterBlocks(tuple(block_ids)))
            scatter_kv(self.tp, self.layout, self.local, block_ids, payload)
        except Exception as e:
            leave(f"a KV scatter failed: {e}")


class RankWatch:
    """Rank 0's watch on this node's other ranks, from their start: one that exits while the group
    is up (loading, serving) takes the worker out."""

    def __init__(self, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        self.procs = list(procs)
        self.stopping = False
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True, name=f"rank-{rank}").start()

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not self.stopping:
            leave(f"rank {rank} (pid {proc.pid}) exited with code {code}")


class ParallelExecutor:
    """The ForwardExecutor of rank 0 (``local``, over rank 0's shard) that first tells every
    other rank to run the same forward."""

    def __init__(
        self,
        local: ForwardExecutor,
        full_spec: KVSpec,
        channel: RankChannel,
        tp: TPGroup,
        layout: RankLayout,
        watch: RankWatch,
    ) -> None:
        self.local = local
        self.device = local.device
        self.channel = channel
        self.tp = tp
        self.kv_cache = ShardedKVCache(local.kv_cache, full_spec, channel, tp, layout)
        self.watch = watch

    @property
    def last_hidden(self) -> torch.Tensor | None:
        return self.local.last_hidden

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        try:
            self.channel.send(batch)
            return self.local.forward(batch)
        except Exception as e:
            log.exception("forward failed on rank 0")
            leave(f"a forward raised on rank 0: {e}")
            raise  # (not reached)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Tell the other ranks to exit, wait for this node's (``timeout_s`` in all, then they
        are killed), and leave the group: the worker is stopping, and a later group in this
        process starts afresh. Runs where the forwards run (the step thread), after the last."""
        self.watch.stopping = True
        try:
            self.channel.send(Stop())  # (a small broadcast: sent, not waited on)
        except Exception:
            log.warning("the other ranks could not be told to stop (this node's are killed)")
        deadline = time.monotonic() + timeout_s
        for proc in self.watch.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            release(proc)
        dist.destroy_process_group()


def threads_per_rank(config: Config) -> int:
    """--num-threads, or this process's CPUs shared out among the node's ranks."""
    ranks_per_node = config.tensor_parallel_size // config.nnodes
    return config.num_threads or max(1, len(os.sched_getaffinity(0)) // ranks_per_node)


@dataclass(frozen=True, slots=True)
class Ranks:
    """Rank 0's end of a started group: the other ranks are loading what ``RankSetup`` said."""

    tp: TPGroup
    channel: RankChannel
    watch: RankWatch  # this node's other ranks

    def drive(self, local: ForwardExecutor, full_spec: KVSpec, layout: RankLayout) -> ParallelExecutor:
        """Tell every rank the pool's size, and drive them through ``local``."""
        self.channel.send(Allocate(local.kv_cache.num_blocks))
        return ParallelExecutor(local, full_spec, self.channel, self.tp, layout, self.watch)


def start_ranks(config: Config, cache_dir: str, path: Path, fmt: str, dtype: torch.dtype) -> Ranks:
    """Start this node's ranks 1..k-1 (other nodes start theirs: ``--node-rank``), join them as
    rank 0, and tell every rank what to load."""
    world = config.tensor_parallel_size
    # A split the model's shape does not allow is refused here, before any rank starts.
    RankLayout.of(config_of(path) if path.is_dir() else read_gguf_config(path), world, config.expert_parallel)
    address = config.dist_init_addr or free_address()
    ranks_per_node = world // config.nnodes
    watch = RankWatch(spawn_ranks(address, range(1, ranks_per_node), world, config, first_local_rank=1))
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    threads = threads_per_rank(config)
    if device.type == "cpu":
        torch.set_num_threads(threads)
    tp, channel = join_group(address, 0, world, device.type, config.max_step_s)
    shm_path = _shm_segment(device, config.nnodes, world)
    setup = RankSetup(
        model_path=str(path),
        cache_dir=cache_dir,
        fmt=fmt,
        dtype=dtype_name(dtype),
        expert_parallel=config.expert_parallel,
        cpu_kernels=config.cpu_kernels,
        num_threads=threads,
        block_size=config.block_size,
        one_thread_max_tokens=config.one_thread_max_tokens,
        shm_name=shm_path.name if shm_path is not None else "",
    )
    try:
        channel.send(setup)
        if shm_path is not None:  # every rank has it open after the barrier: the name can go
            open_shm(tp, shm_path.name, config.max_step_s)
            channel.barrier()
    finally:
        if shm_path is not None:
            shm_path.unlink()  # (no file outlives the group, however it ends)
    log.info("tensor parallel: %d ranks met at %s (%d on this node)", world, address, ranks_per_node)
    return Ranks(tp, channel, watch)


def _shm_segment(device: torch.device, nnodes: int, world: int) -> Path | None:
    """The shared-memory all-reduce's segment, for ranks of one CPU node; None where it does not
    apply or /dev/shm cannot hold it (gloo's all-reduce then runs alone)."""
    if device.type != "cpu" or nnodes != 1 or not shm_all_reduce.supported():
        return None
    name = f"deepinfer-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        return shm_all_reduce.create_segment(name, world)
    except OSError as e:
        log.warning("no shared-memory all-reduce (%s): the ranks all-reduce through gloo", e)
        return None
