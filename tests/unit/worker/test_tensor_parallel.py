"""Tensor and expert parallelism through the real worker: ``build_worker`` with
``tensor_parallel_size`` starts the other ranks as processes (gloo), and their logits, KV pages
and greedy outputs are compared with one rank's, in fp32: SmolLM2 (GQA: its 3 KV heads split
2 + 1) and the tiny DeepSeek-V3 (MLA by head; MoE tensor- and expert-parallel; 3 ranks over 4
heads and 8 experts, uneven)."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deepinfer.local_engine import LocalEngine
from libs.models.sharding import LocalExperts
from libs.models.tiny_deepseek import deepseek_v4_tokenizer_dir, write_tiny_checkpoint
from libs.protocol.messages import SamplingParams
from services.scheduler.limits import Limits
from services.worker.config import Config
from services.worker.forward_executor import ForwardBatch
from services.worker.main import Worker, build_worker
from services.worker.parallel_executor import ParallelExecutor
from services.worker.parallel_group import free_address

ATOL = 1e-4  # an all-reduce adds the ranks' parts in another order than one rank's matmul


def _config(model: str, tp: int, ep: bool = False) -> Config:
    return Config(
        model=model,
        dtype="float32",
        tensor_parallel_size=tp,
        expert_parallel=ep,
        kv_cache_gb=0.02,
        host_cache_gb=0,
        kv_store_path="none",
        max_num_seqs=4,
    )


@contextlib.contextmanager
def running(config: Config, cache_dir: Path) -> Iterator[Worker]:
    threads = torch.get_num_threads()  # a rank takes its share of the CPUs: give them back after
    worker = build_worker(config, str(cache_dir), profile=False)
    try:
        yield worker
    finally:
        worker.close()
        torch.set_num_threads(threads)


def _steps(vocab: int) -> list[ForwardBatch]:
    """Two sequences: a prefill in two chunks beside a prompt that then decodes, then a decode of
    both; pages 0-2 and 3-4 (16-token blocks). Every position's logits."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(3, min(vocab, 40000), (34,), generator=gen).tolist()
    b = torch.randint(3, min(vocab, 40000), (11,), generator=gen).tolist()
    tables = [[0, 1, 2], [3, 4]]

    def batch(
        ids: list[int], positions: list[int], query_lens: list[int], context_lens: list[int]
    ) -> ForwardBatch:
        return ForwardBatch(ids, positions, query_lens, context_lens, tables, list(range(len(ids))))

    return [
        batch(a[:20] + b[:9], [*range(20), *range(9)], [20, 9], [0, 0]),
        batch(a[20:33] + b[9:10], [*range(20, 33), 9], [13, 1], [20, 9]),
        batch([a[33], b[10]], [33, 10], [1, 1], [33, 10]),
    ]


def _run(worker: Worker) -> tuple[list[torch.Tensor], torch.Tensor]:
    executor = worker.runner.executor
    with torch.inference_mode():
        logits = [executor.forward(batch) for batch in _steps(worker.runner.shape.vocab_size)]
        pages = executor.kv_cache.gather_blocks([0, 1, 2, 3, 4])
    assert all(x is not None for x in logits)
    return [x for x in logits if x is not None], pages


def _greedy(worker: Worker, eos_token_id: int) -> dict[str, list[int]]:
    """Three prompts through the scheduler core and this worker's runner: batched, chunked (24
    tokens a step), overlapped."""
    runner = worker.runner
    limits = Limits(runner.kv_cache.num_blocks, runner.block_size, 4, 512, 24, 16)
    engine = LocalEngine(runner, limits, eos_token_id, overlap=True, check=True)
    gen = torch.Generator().manual_seed(1)
    vocab = min(runner.shape.vocab_size, 40000)
    for i, length in enumerate((30, 7, 19)):
        prompt = torch.randint(3, vocab, (length,), generator=gen).tolist()
        engine.add(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    return engine.run()


def _assert_close(
    one: tuple[list[torch.Tensor], torch.Tensor], many: tuple[list[torch.Tensor], torch.Tensor]
) -> None:
    for step, (x, y) in enumerate(zip(one[0], many[0], strict=True)):
        assert x.shape == y.shape
        assert (x - y).abs().max().item() < ATOL, f"step {step}"
        assert torch.equal(x.argmax(-1), y.argmax(-1)), f"step {step}"
    assert one[1].shape == many[1].shape  # whole pages: every rank's heads, in order
    assert (one[1] - many[1]).abs().max().item() < ATOL


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp-cache")


@pytest.fixture(scope="module")
def smollm2_tp1(
    cache_dir: Path,
) -> Iterator[tuple[tuple[list[torch.Tensor], torch.Tensor], dict[str, list[int]], str]]:
    with running(_config("smollm2", 1), cache_dir) as worker:
        yield _run(worker), _greedy(worker, 2), worker.fingerprint


def test_smollm2_two_ranks_equal_one(smollm2_tp1, cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    with running(_config("smollm2", 2), cache_dir) as worker:
        executor = worker.runner.executor
        assert isinstance(executor, ParallelExecutor)
        assert executor.local.kv_cache.kv_spec.num_kv_heads == 2  # rank 0 holds 2 of the 3 KV heads
        result = _run(worker)
        _assert_close(smollm2_tp1[0], result)
        assert _greedy(worker, 2) == smollm2_tp1[1]
        # The layout is in the fingerprint: a TP=1 worker never reads these blocks.
        assert worker.fingerprint != smollm2_tp1[2]
        # A page written whole (G2 / G3 loads) reaches every rank's heads and reads back the same.
        with torch.inference_mode():
            executor.kv_cache.scatter_blocks([7, 8], result[1][:2])
            assert torch.equal(executor.kv_cache.gather_blocks([7, 8]), result[1][:2])


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-deepseek-tp")
    write_tiny_checkpoint(directory, seed=7, tokenizer_dir=deepseek_v4_tokenizer_dir())
    return directory


@pytest.fixture(scope="module")
def deepseek_tp1(
    deepseek: Path, cache_dir: Path
) -> Iterator[tuple[tuple[list[torch.Tensor], torch.Tensor], dict[str, list[int]]]]:
    with running(_config(str(deepseek), 1), cache_dir) as worker:
        yield _run(worker), _greedy(worker, 1)


@pytest.mark.parametrize(("tp", "ep", "local_experts"), [(2, False, 0), (2, True, 4), (3, True, 3)])
def test_deepseek_ranks_equal_one(
    deepseek_tp1, deepseek: Path, cache_dir: Path, tp: int, ep: bool, local_experts: int
) -> None:  # type: ignore[no-untyped-def]
    with running(_config(str(deepseek), tp, ep), cache_dir) as worker:
        executor = worker.runner.executor
        assert isinstance(executor, ParallelExecutor)
        moe = executor.local.model.layers[1].mlp.inner  # type: ignore[attr-defined, union-attr]
        if ep:  # whole experts on this rank (3 ranks: 3, 3 and 2 of the 8)
            assert (
                isinstance(moe.experts, LocalExperts) and moe.experts.gate_up_proj.shape[0] == local_experts
            )
        else:  # every expert, a slice of its channels
            assert moe.experts.gate_up_proj.shape[0] == 8
        _assert_close(deepseek_tp1[0], _run(worker))
        assert _greedy(worker, 1) == deepseek_tp1[1]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tensor_parallel_size": 3, "nnodes": 2}, "whole number of ranks per node"),
        ({"tensor_parallel_size": 2, "nnodes": 2}, "dist_init_addr"),
        ({"tensor_parallel_size": 2, "speculative_method": "mtp"}, "mtp"),
        ({"tensor_parallel_size": 2, "deterministic": True}, "deterministic"),
        ({"tensor_parallel_size": 0}, "size >= 1"),
    ],
)
def test_config_refuses(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config(**fields)  # type: ignore[arg-type]


def test_ranks_on_two_nodes(smollm2_tp1, cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 started on its own, as on a second node (``deepinfer worker --node-rank 1``), joins
    rank 0 at ``--dist-init-addr``; it runs until rank 0 stops the group, then exits cleanly."""
    address = free_address()
    argv = [sys.executable, "-m", "deepinfer", "worker", "--tensor-parallel-size", "2", "--nnodes", "2"]
    argv += ["--node-rank", "1", "--dist-init-addr", address]
    node1 = subprocess.Popen(argv)
    try:
        config = dataclasses.replace(_config("smollm2", 2), nnodes=2, dist_init_addr=address)
        with running(config, cache_dir) as worker:
            executor = worker.runner.executor
            assert isinstance(executor, ParallelExecutor) and not executor.watch.procs  # none started here
            _assert_close(smollm2_tp1[0], _run(worker))
        assert node1.wait(30) == 0
    finally:
        node1.kill()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_smollm2_two_gpus_equal_one(cache_dir: Path) -> None:
    """The NCCL path: TP=2 over cuda:0 and cuda:1 against TP=1 on cuda:0, fp32 (TF32 off)."""
    results = []
    for tp in (1, 2):
        with running(dataclasses.replace(_config("smollm2", tp), device="cuda"), cache_dir) as worker:
            results.append(_run(worker))
    _assert_close(results[0], results[1])
