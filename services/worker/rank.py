"""A tensor-parallel worker's other ranks: ``python -m services.worker.rank --dist-init-addr
HOST:PORT --rank R --world-size N``, started by rank 0 (or on another node by ``deepinfer worker
--node-rank K``). A rank joins the group, loads its shard as rank 0's ``RankSetup`` says, then
runs rank 0's commands until told to stop: no bus, no sequences, no sampling.

Any failure ends the process: its sockets close, so rank 0's next collective fails and the worker
leaves (parallel_executor.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from pathlib import Path

import torch

from libs.kernels import cpu_ext
from libs.models.parallel import TPGroup
from libs.models.sharding import RankLayout, Shard
from libs.runtime.logs import setup_logging
from services.worker.config import Config
from services.worker.forward_executor import ForwardBatch, ForwardExecutor, ModelShape
from services.worker.kv_store import dtype_name
from services.worker.model_loading import load_model, resolve_dtype
from services.worker.parallel_group import (
    Allocate,
    GatherBlocks,
    RankChannel,
    RankSetup,
    ScatterBlocks,
    Stop,
    exit_with_parent,
    gather_kv,
    join_group,
    open_shm,
    scatter_kv,
    shard_executor,
    shard_shape,
    spawn_ranks,
)

log = logging.getLogger("deepinfer.worker.rank")


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device of a node's local rank ``local_rank`` when the worker runs on ``device``."""
    base = torch.device(device)
    if base.type == "cpu":
        return base
    return torch.device(base.type, (base.index or 0) + local_rank)


def follow(address: str, rank: int, world_size: int, device: torch.device, timeout_s: float) -> None:
    """Join, load this rank's shard, and run rank 0's commands until ``Stop``."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp, channel = join_group(address, rank, world_size, device.type, timeout_s)
    setup = channel.receive()
    assert isinstance(setup, RankSetup), f"expected the setup first, got {type(setup).__name__}"
    if setup.shm_name:
        open_shm(tp, setup.shm_name, timeout_s)
        channel.barrier()
    if device.type == "cpu":
        cpu_ext.configure(setup.cpu_kernels, Path(setup.cache_dir) / "kernels")
        torch.set_num_threads(setup.num_threads)
    shard = Shard(tp, setup.expert_parallel)
    model = load_model(Path(setup.model_path), Path(setup.cache_dir), setup.fmt, device, shard=shard)
    dtype = resolve_dtype(setup.fmt, device)
    if dtype_name(dtype) != setup.dtype:  # e.g. int8 where this rank's CPU kernels did not build
        raise RuntimeError(f"--dtype {setup.fmt} means {dtype_name(dtype)} here, {setup.dtype} on rank 0")
    allocate = channel.receive()
    assert isinstance(allocate, Allocate), f"expected the pool's size, got {type(allocate).__name__}"
    shape = shard_shape(ModelShape.of(model.config), model.config, shard)
    executor = shard_executor(
        model, shape, allocate.num_blocks, setup.block_size, dtype, device, setup.one_thread_max_tokens
    )
    log.info("rank %d of %d: shard loaded on %s, %d KV blocks", rank, world_size, device, allocate.num_blocks)
    with torch.inference_mode():
        run_commands(channel, executor, tp, shard.layout(model.config))


def follow_node(config: Config) -> None:
    """``deepinfer worker --node-rank K`` (K > 0): this node's ranks of a worker whose rank 0 runs
    on node 0 and listens at ``--dist-init-addr``; the first here, the rest as children."""
    per_node = config.tensor_parallel_size // config.nnodes
    first = config.node_rank * per_node
    spawn_ranks(
        config.dist_init_addr, range(first + 1, first + per_node), config.tensor_parallel_size, config, 1
    )
    device = rank_device(config.device, 0)
    follow(config.dist_init_addr, first, config.tensor_parallel_size, device, config.max_step_s)


def run_commands(channel: RankChannel, executor: ForwardExecutor, tp: TPGroup, layout: RankLayout) -> None:
    """Rank 0's commands, in order, until ``Stop``."""
    while True:
        command = channel.receive()
        if isinstance(command, ForwardBatch):
            executor.forward(command)
        elif isinstance(command, GatherBlocks):
            gather_kv(tp, layout, executor.kv_cache, command.block_ids)
        elif isinstance(command, ScatterBlocks):
            scatter_kv(tp, layout, executor.kv_cache, command.block_ids, None)
        elif isinstance(command, Stop):
            return
        else:
            raise RuntimeError(f"unexpected command {type(command).__name__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dist-init-addr", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True, help="on this node: picks cuda:<i + k>")
    parser.add_argument("--device", default="cpu", help="the worker's --device")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="of a collective")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-format", default="text")
    parser.add_argument("--parent-fd", type=int, default=-1, help="EOF on it: the parent is gone")
    args = parser.parse_args()
    # Rank 0 stops this process (a Stop command) or, gone, ends it through the pipe; signals that
    # reach the whole process group or cgroup are rank 0's to act on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.parent_fd >= 0:
        exit_with_parent(args.parent_fd)
    setup_logging(args.log_level, f"worker-rank{args.rank}", args.log_format)
    code = 0
    try:
        device = rank_device(args.device, args.local_rank)
        follow(args.dist_init_addr, args.rank, args.world_size, device, args.timeout_s)
    except Exception:
        log.exception("rank %d failed", args.rank)
        code = 1
    logging.shutdown()
    os._exit(code)  # no teardown: a broken group's destructors abort


if __name__ == "__main__":
    main()
