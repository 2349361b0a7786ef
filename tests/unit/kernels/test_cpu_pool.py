"""The CPU kernels' thread pool (csrc/pool.h): a kernel's result does not depend on how many
threads split it, calls from several threads at once are each right, and a forked child runs the
kernels (alone: the parent's helper threads do not exist there)."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from libs.kernels import cpu_ext
from libs.kernels.int8_linear import (
    INT16_MIN_ROWS,
    int8_linear,
    int8_linear_int16_reference,
    int8_linear_reference,
    int16_products,
)

pytestmark = pytest.mark.skipif(cpu_ext.ops() is None, reason="the CPU extension did not build here")

THREAD_COUNTS = (1, 2, 3, 5)


@pytest.fixture(autouse=True)
def kernel_threads_reset() -> Iterator[None]:
    yield
    cpu_ext.set_num_threads(0)


def int8_case(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, 512], an int8 weight [1040, 512] (above the size the kernel runs on one thread,
    and a feature count no chunking divides evenly) and its scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 512, generator=g)
    weight = torch.randint(-127, 128, (1040, 512), dtype=torch.int8, generator=g)
    return x, weight, torch.rand(1040, generator=g) / 100


def paged_case() -> Callable[[], torch.Tensor]:
    """Decode attention of 8 rows over 100-140 keys each (enough to split over threads)."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block_size, rows = 9, 3, 64, 16, 8
    lens = [100 + 5 * r for r in range(rows)]
    per_row = max(lens) // block_size + 1
    k_cache = torch.randn(rows * per_row, block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(rows * per_row, block_size, kv_heads, dim, generator=g)
    tables = torch.randperm(rows * per_row, generator=g).to(torch.int32).view(rows, per_row)
    q = torch.randn(rows, heads, dim, generator=g)
    index = torch.arange(rows, dtype=torch.int32)
    num_keys = torch.tensor(lens, dtype=torch.int32)
    ops = cpu_ext.ops()
    assert ops is not None

    def run() -> torch.Tensor:
        out = torch.zeros_like(q)
        ops.paged_attention(out, q, k_cache, v_cache, tables, index, index, num_keys, dim**-0.5)
        return out

    return run


def pointwise_case() -> Callable[[], torch.Tensor]:
    """rms_norm and silu_mul over enough rows to split."""
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(4096, 64, generator=g), torch.rand(64, generator=g)
    gate_up = torch.randn(1024, 256, generator=g)
    ops = cpu_ext.ops()
    assert ops is not None
    return lambda: torch.cat([ops.rms_norm(x, weight, 1e-6).flatten(), ops.silu_mul(gate_up).flatten()])


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_int8_linear_is_the_same_on_any_number_of_threads(rows: int) -> None:
    x, weight, scales = int8_case(rows)
    results = []
    for n in THREAD_COUNTS:
        cpu_ext.set_num_threads(n)
        results.append(int8_linear(x, weight, scales, int16_activations=True))
    assert all(torch.equal(results[0], r) for r in results[1:])
    rounded = rows >= INT16_MIN_ROWS and int16_products()  # the arithmetic the kernel chose
    reference = (int8_linear_int16_reference if rounded else int8_linear_reference)(x, weight, scales)
    atol = 2e-5 * float(reference.abs().max())  # fp32 sums: within their rounding of the largest
    torch.testing.assert_close(results[0], reference, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("case", [paged_case, pointwise_case])
def test_attention_and_pointwise_ops_are_the_same_on_any_number_of_threads(
    case: Callable[[], Callable[[], torch.Tensor]],
) -> None:
    run = case()
    results = []
    for n in THREAD_COUNTS:
        cpu_ext.set_num_threads(n)
        results.append(run())
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_calls_from_several_threads_at_once_are_each_right() -> None:
    """One job runs on the pool at a time; a call that finds it busy runs on its own thread."""
    cpu_ext.set_num_threads(2)
    cases = [int8_case(rows, seed=rows) for rows in (1, 2, 4, 8)]
    expected = [int8_linear(*case, int16_activations=True) for case in cases]
    wrong: list[int] = []

    def hammer(i: int) -> None:
        for _ in range(30):
            if not torch.equal(int8_linear(*cases[i], int16_activations=True), expected[i]):
                wrong.append(i)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and wrong == []


def _child(queue: multiprocessing.Queue[bool]) -> None:
    x, weight, scales = int8_case(8)
    queue.put(torch.equal(int8_linear(x, weight, scales, int16_activations=True), _child_expected))


_child_expected = torch.empty(0)


def test_a_forked_child_runs_the_kernels() -> None:
    global _child_expected
    cpu_ext.set_num_threads(2)
    x, weight, scales = int8_case(8)
    _child_expected = int8_linear(x, weight, scales, int16_activations=True)  # the helpers now exist
    context = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[bool] = context.Queue()
    child = context.Process(target=_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0 and queue.get(timeout=5) is True


def test_a_negative_thread_count_is_refused() -> None:
    with pytest.raises(RuntimeError, match="n >= 0"):
        cpu_ext.set_num_threads(-1)
