"""The batch-invariant attention backend: close to the per-row reference, and bit for bit the same
output for a query whatever else its step holds (other rows, longer rows padding its keys, the
prompt chunked otherwise, its queries split across blocks)."""

from __future__ import annotations

import itertools

import pytest
import torch

from libs.kernels import paged_attention_invariant
from libs.kernels.paged_attention import (
    PagedAttentionMetadata,
    make_attention_backend,
    paged_attention_reference,
)
from libs.kernels.paged_attention_invariant import KV_CHUNK, BatchInvariantAttentionBackend
from tests.unit.kernels.test_paged_attention import CASES, SMOLLM2, random_step

HEADS = SMOLLM2  # num_heads, num_kv_heads, head_dim
# The extension's kernel (the worker's path where it builds, as it does wherever the tests run) and
# the chunked torch products (the fallback).
KERNEL = pytest.mark.parametrize("use_kernel", [False, True], ids=["chunked", "kernel"])


def make_backend(use_kernel: bool, dtype: torch.dtype = torch.bfloat16) -> BatchInvariantAttentionBackend:
    backend = BatchInvariantAttentionBackend(*HEADS, dtype, use_kernel=use_kernel)
    assert backend.use_kernel == use_kernel
    return backend


def test_the_cpu_backend_takes_the_kernel() -> None:
    backend = make_attention_backend(torch.device("cpu"), *HEADS, torch.bfloat16, batch_invariant=True)
    assert isinstance(backend, BatchInvariantAttentionBackend) and backend.use_kernel


@KERNEL
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_reference(case: str, dtype: torch.dtype, use_kernel: bool) -> None:
    meta, tensors = random_step(CASES[case], 16, HEADS, dtype, seed=2)
    q, k, v, k_cache, v_cache = tensors
    backend = make_backend(use_kernel, dtype)
    backend.plan(meta)
    out = backend.forward(q, k, v, k_cache, v_cache)
    expected = paged_attention_reference(q, k_cache, v_cache, meta)
    assert out.dtype == dtype and out.shape == q.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)
        assert (out.float() - expected.float()).abs().mean() < 3e-3


class _Sequence:
    """One sequence's q/k/v for all its positions and its pages in a shared cache."""

    def __init__(self, length: int, table: list[int], g: torch.Generator) -> None:
        num_heads, num_kv_heads, head_dim = HEADS
        self.table = table
        self.q = torch.randn(length, num_heads, head_dim, generator=g).bfloat16()
        self.k = torch.randn(length, num_kv_heads, head_dim, generator=g).bfloat16()
        self.v = torch.randn(length, num_kv_heads, head_dim, generator=g).bfloat16()


def _run_step(
    backend: BatchInvariantAttentionBackend,
    caches: tuple[torch.Tensor, torch.Tensor],
    rows: list[tuple[_Sequence, int, int]],
) -> list[torch.Tensor]:
    """One step computing positions [start, end) of each sequence (multi-token rows first)."""
    meta = PagedAttentionMetadata.build(
        [end - start for _, start, end in rows],
        [start for _, start, _ in rows],
        [s.table for s, _, _ in rows],
        16,
    )
    backend.plan(meta)
    q = torch.cat([s.q[a:b] for s, a, b in rows])
    k = torch.cat([s.k[a:b] for s, a, b in rows])
    v = torch.cat([s.v[a:b] for s, a, b in rows])
    out = backend.forward(q, k, v, *caches)
    bounds = meta.query_start_loc.tolist()
    return [out[bounds[i] : bounds[i + 1]] for i in range(len(rows))]


def _caches() -> tuple[torch.Tensor, torch.Tensor]:
    shape = (80, 16, HEADS[1], HEADS[2])
    return torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)


@KERNEL
def test_a_query_is_computed_alike_in_any_batch(monkeypatch: pytest.MonkeyPatch, use_kernel: bool) -> None:
    """Sequence A (200 tokens) alone, whole, then decoded; the same with a long sequence B beside it
    (its keys pad A's decode batch to more chunks), with A's prompt in other chunks, and with small
    query blocks: every output of A is bit-identical."""
    g = torch.Generator().manual_seed(0)
    a = _Sequence(200, list(range(0, 13)), g)
    b = _Sequence(700, list(range(13, 57)), g)
    backend = make_backend(use_kernel)

    def alone() -> list[torch.Tensor]:
        caches = _caches()
        outs = _run_step(backend, caches, [(a, 0, 190)])
        return outs + [_run_step(backend, caches, [(a, p, p + 1)])[0] for p in range(190, 200)]

    def beside_b(chunks: list[int]) -> torch.Tensor:
        caches = _caches()
        _run_step(backend, caches, [(b, 0, 690)])
        b_next = 690  # B decodes one token in every step after its prompt

        def with_b(a_row: tuple[_Sequence, int, int]) -> torch.Tensor:
            nonlocal b_next
            b_row = (b, b_next, b_next + 1)
            b_next += 1
            multi = a_row[2] - a_row[1] > 1  # multi-token rows come first in a step
            return _run_step(backend, caches, [a_row, b_row] if multi else [b_row, a_row])[0 if multi else 1]

        bounds = [0, *chunks, 190]
        outs = [with_b((a, start, end)) for start, end in itertools.pairwise(bounds)]
        position = 190
        while position < 200:  # decodes batched with B's, and every other step verifying 3 at once
            n = 3 if position % 2 == 0 and position + 3 <= 200 else 1
            outs.append(with_b((a, position, position + n)))
            position += n
        return torch.cat(outs)

    reference = torch.cat(alone())
    assert torch.equal(beside_b([24, 48, 100]), reference)
    assert torch.equal(beside_b([7]), reference)
    monkeypatch.setattr(paged_attention_invariant, "QUERY_BLOCK", 5)
    assert torch.equal(torch.cat(alone()), reference)
    # Against the reference, as a check that the comparison is not of two empty things.
    assert reference.shape == (200, HEADS[0], HEADS[2]) and reference.abs().sum() > 0


def test_keys_span_whole_chunks_past_a_short_table() -> None:
    # A 3-token row whose table is one block: its chunk of KV_CHUNK keys reads block 0 for the rest.
    backend = make_backend(use_kernel=False)
    meta, tensors = random_step([(3, 0), (1, 5)], 16, HEADS, torch.bfloat16, seed=4)
    backend.plan(meta)
    assert all(batch.kv_index.numel() % (KV_CHUNK * HEADS[1]) == 0 for batch in backend._batches)
    out = backend.forward(*tensors)
    assert torch.isfinite(out.float()).all()


@KERNEL
@pytest.mark.parametrize("seed", range(6))
def test_every_row_of_a_random_step_is_computed_as_alone(seed: int, use_kernel: bool) -> None:
    """Rows of random lengths around chunk boundaries (decodes, and rows with context of up to 40
    queries): each row's output equals the same row planned alone, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    num_prefills = int(torch.randint(0, 3, (1,), generator=g))
    num_decodes = int(torch.randint(1, 9, (1,), generator=g))
    contexts = [
        int(c) for c in torch.randint(0, 3 * KV_CHUNK + 2, (num_prefills + num_decodes,), generator=g)
    ]
    query_lens = [int(q) for q in torch.randint(2, 41, (num_prefills,), generator=g)] + [1] * num_decodes
    meta, tensors = random_step(list(zip(query_lens, contexts, strict=True)), 16, HEADS, torch.bfloat16, seed)
    q, k, v, k_cache, v_cache = tensors
    backend = make_backend(use_kernel)
    backend.plan(meta)
    together = backend.forward(q, k, v, k_cache, v_cache)
    starts, tables = meta.query_start_loc.tolist(), meta.block_tables.tolist()
    for row, (query_len, context_len) in enumerate(zip(query_lens, contexts, strict=True)):
        a, b = starts[row], starts[row + 1]
        alone = PagedAttentionMetadata.build([query_len], [context_len], [tables[row]], 16)
        backend.plan(alone)
        assert torch.equal(backend.forward(q[a:b], k[a:b], v[a:b], k_cache, v_cache), together[a:b]), row
