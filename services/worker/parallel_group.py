"""The process group of a tensor-parallel worker: how its ranks start and meet, what rank 0 tells
the others, and the KV moves between rank 0 and every rank's pages.

Rank 0 is the worker the bus sees (plans, sampling, grammars and KV tiers stay there); ranks
1..N-1 (``services.worker.rank``) run only their shard of each forward. Two groups join them:

- the default group (gloo on CPU, NCCL on CUDA) carries the forwards' collectives and the KV
  moves, with a timeout of ``max_step_s``: a rank that stops answering fails the step, and the
  worker, instead of hanging it;
- a gloo control group carries rank 0's commands (``RankSetup`` once, then ``Allocate``, then a
  ``ForwardBatch`` per forward or a KV move), with no practical timeout: an idle worker sends none.

A rank that dies closes its sockets, so the others' next collective or command fails at once.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from libs.kvstore.kv_spec import MHA
from libs.modelfiles.deepseek_config import DeepseekV3Config
from libs.modelfiles.llama_config import LlamaConfig
from libs.models.parallel import TPGroup
from libs.models.sharding import RankLayout, Shard
from libs.models.shm_all_reduce import SHM_DIR, ShmAllReduce
from services.worker.config import Config
from services.worker.forward_executor import CausalLM, ForwardBatch, ForwardExecutor, ModelShape
from services.worker.kv_cache import KVCache

NO_TIMEOUT = datetime.timedelta(days=3650)
HEAD_AXIS = 4  # of pages as gathered: [n, num_layers, num_planes, block_size, num_kv_heads, head_dim]


@dataclass(frozen=True, slots=True)
class RankSetup:
    """What every rank loads and how it runs: rank 0 decides, the others follow."""

    model_path: str
    cache_dir: str
    fmt: str  # the weight format (a resolved --dtype)
    dtype: str  # the activations' (rank 0's resolve_dtype: every rank must use the same)
    expert_parallel: bool
    cpu_kernels: bool
    num_threads: int  # per rank
    block_size: int
    one_thread_max_tokens: int
    shm_name: str  # the shared-memory all-reduce's segment under /dev/shm ('': gloo's only)


@dataclass(frozen=True, slots=True)
class Allocate:
    num_blocks: int  # KV pages per rank, the same on every rank


@dataclass(frozen=True, slots=True)
class GatherBlocks:
    block_ids: tuple[int, ...]  # every rank sends its heads of these pages to rank 0


@dataclass(frozen=True, slots=True)
class ScatterBlocks:
    block_ids: tuple[int, ...]  # rank 0 sends every rank its heads of these pages


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Command = RankSetup | Allocate | ForwardBatch | GatherBlocks | ScatterBlocks | Stop


class RankChannel:
    """Rank 0's commands to every other rank, in order, over the control group."""

    def __init__(self, control: dist.ProcessGroup) -> None:
        self.control = control

    def send(self, command: Command) -> None:
        dist.broadcast_object_list([command], src=0, group=self.control)

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def receive(self) -> Command:
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        command = box[0]
        assert isinstance(command, Command), f"not a command: {type(command).__name__}"
        return command


def join_group(
    address: str, rank: int, world_size: int, device_type: str, timeout_s: float
) -> tuple[TPGroup, RankChannel]:
    """Meet the other ranks at ``address`` (host:port, where rank 0 listens)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    control = dist.new_group(backend="gloo", timeout=NO_TIMEOUT)
    return TPGroup(rank, world_size, dist.group.WORLD), RankChannel(control)


def open_shm(tp: TPGroup, name: str, timeout_s: float) -> None:
    """Route ``tp``'s all-reduces that fit through the segment ``name`` (made by rank 0)."""
    tp.shm = ShmAllReduce(SHM_DIR / name, tp.rank, tp.size, timeout_s)


def free_address() -> str:
    """A loopback address with a port nobody listens on now, for a one-node group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def spawn_ranks(
    address: str, ranks: Sequence[int], world_size: int, config: Config, first_local_rank: int
) -> list[subprocess.Popen[bytes]]:
    """Start ``ranks`` as child processes (``python -m services.worker.rank``), local ranks
    ``first_local_rank``, ... Each holds the read end of a pipe whose write end only this process
    holds: when this process is gone, however it went, the child reads EOF and exits
    (``exit_with_parent``). Each runs in a session of its own, so a terminal's Ctrl-C or a
    signal to this process group reaches rank 0 alone, which stops the ranks itself."""
    procs = []
    for local_rank, rank in enumerate(ranks, start=first_local_rank):
        read_end, write_end = os.pipe()
        argv = [sys.executable, "-m", "services.worker.rank", "--dist-init-addr", address]
        argv += ["--rank", str(rank), "--local-rank", str(local_rank), "--world-size", str(world_size)]
        argv += ["--device", config.device, "--timeout-s", str(config.max_step_s)]
        argv += ["--log-level", config.log_level, "--log-format", config.log_format]
        argv += ["--parent-fd", str(read_end)]
        procs.append(subprocess.Popen(argv, pass_fds=(read_end,), start_new_session=True))
        os.close(read_end)
        _parent_ends[procs[-1].pid] = write_end  # (os.pipe's ends are not inherited by other children)
    return procs


_parent_ends: dict[int, int] = {}  # a started rank's pid -> this process's end of its pipe


def release(proc: subprocess.Popen[bytes]) -> None:
    """Close this process's end of an exited rank's pipe."""
    fd = _parent_ends.pop(proc.pid, None)
    if fd is not None:
        os.close(fd)


def exit_with_parent(fd: int) -> None:
    """In a rank: exit at once when the process that started it is gone (EOF on ``fd``)."""

    def watch() -> None:
        while os.read(fd, 1):
            pass
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def shard_shape(shape: ModelShape, config: LlamaConfig | DeepseekV3Config, shard: Shard) -> ModelShape:
    """The model's shape as rank ``shard.tp.rank`` holds it: its query heads and its KV."""
    layout, rank = shard.layout(config), shard.tp.rank
    return dataclasses.replace(
        shape, num_heads=layout.num_heads(config, rank), kv_spec=layout.kv_spec(shape.kv_spec, rank)
    )


def shard_executor(
    model: CausalLM,
    shape: ModelShape,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    one_thread_max_tokens: int,
) -> ForwardExecutor:
    """A rank's executor over its shard (``shape`` from ``shard_shape``). Op by op: the fused
    decoder blocks run every layer in one op, with no point between layers for an all-reduce."""
    return ForwardExecutor(
        model,
        shape,
        num_blocks,
        block_size,
        dtype,
        device,
        fuse_blocks=False,
        one_thread_max_tokens=one_thread_max_tokens if device.type == "cpu" else 0,
    )


def gather_kv(tp: TPGroup, layout: RankLayout, kv_cache: KVCache, block_ids: Sequence[int]) -> torch.Tensor:
    """On rank 0: the whole pages ``block_ids`` ([n, *full block shape]), every rank's heads in
    rank order; elsewhere: this rank's part (sent). MLA pages are the same on every rank: rank 0
    reads its own (the other ranks are not asked)."""
    local = kv_cache.gather_blocks(block_ids)
    if kv_cache.kv_spec.kind != MHA or tp.size == 1:
        return local
    widest = max(len(r) for r in layout.kv_heads)
    padded = _pad_heads(local, widest).contiguous()
    parts = [torch.empty_like(padded) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(padded, parts, dst=0, group=tp.group)
    if parts is None:
        return local
    heads = [part.narrow(HEAD_AXIS, 0, len(r)) for part, r in zip(parts, layout.kv_heads, strict=True)]
    return torch.cat(heads, dim=HEAD_AXIS)


def scatter_kv(
    tp: TPGroup, layout: RankLayout, kv_cache: KVCache, block_ids: Sequence[int], payload: torch.Tensor | None
) -> None:
    """Write the pages ``block_ids`` on every rank from rank 0's whole ``payload`` (None elsewhere):
    each rank its heads (MHA), or every rank all of it (MLA)."""
    if tp.size == 1:
        assert payload is not None
        kv_cache.scatter_blocks(block_ids, payload)
        return
    shape = (len(block_ids), *kv_cache.block_shape)
    if kv_cache.kv_spec.kind != MHA:
        whole = payload.to(kv_cache.device) if payload is not None else None
        buffer = (
            whole if whole is not None else torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
        )
        dist.broadcast(buffer, src=0, group=tp.group)
        kv_cache.scatter_blocks(block_ids, buffer)
        return
    widest = max(len(r) for r in layout.kv_heads)
    padded_shape = (*shape[:HEAD_AXIS], widest, shape[-1])
    received = torch.empty(padded_shape, dtype=kv_cache.dtype, device=kv_cache.device)
    parts = None
    if payload is not None:
        payload = payload.to(kv_cache.device)
        parts = [
            _pad_heads(payload.narrow(HEAD_AXIS, r.start, len(r)), widest).contiguous()
            for r in layout.kv_heads
        ]
    dist.scatter(received, parts, src=0, group=tp.group)
    kv_cache.scatter_blocks(
        block_ids, received.narrow(HEAD_AXIS, 0, len(layout.kv_heads[tp.rank])).contiguous()
    )


def _pad_heads(blocks: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Zero heads appended on the head axis up to ``num_heads`` (uneven splits travel padded)."""
    missing = num_heads - blocks.shape[HEAD_AXIS]
    return blocks if missing == 0 else F.pad(blocks, (0, 0, 0, missing))
