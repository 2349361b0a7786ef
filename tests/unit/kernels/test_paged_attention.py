"""Paged attention: metadata layout, the CPU backend against the per-row reference, cache writes,
chunked prefill against one whole prefill, and (on CUDA) the flashinfer backend."""

from __future__ import annotations

import pytest
import torch

from libs.kernels import cpu_ext
from libs.kernels.paged_attention import (
    PagedAttentionMetadata,
    make_attention_backend,
    paged_attention_reference,
)
from libs.kernels.paged_attention_torch import DECODE_GROUP_SLACK_TOKENS, TorchAttentionBackend, decode_groups

Row = tuple[int, int]  # (query_len, context_len)

SMOLLM2 = (9, 3, 64)  # num_heads, num_kv_heads, head_dim
MIXED: list[Row] = [(7, 0), (5, 9), (23, 40), (1, 30), (1, 3), (1, 0), (1, 17)]


def make_layout(rows: list[Row], block_size: int, g: torch.Generator) -> tuple[list[list[int]], int]:
    """Block tables drawn from a shuffled pool (block 0 included), some with spare blocks at the end."""
    needed = [-(-(q + c) // block_size) for q, c in rows]
    spare = [r % 2 for r in range(len(rows))]
    num_blocks = sum(needed) + sum(spare) + 3
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n, extra in zip(needed, spare, strict=True):
        tables.append(pool[used : used + n + extra])
        used += n + extra
    return tables, num_blocks


def random_step(
    rows: list[Row], block_size: int, heads: tuple[int, int, int], dtype: torch.dtype, seed: int = 0
) -> tuple[PagedAttentionMetadata, list[torch.Tensor]]:
    """Metadata, q/k/v for the new tokens, and caches full of random (finite) data."""
    num_heads, num_kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(seed)
    tables, num_blocks = make_layout(rows, block_size, g)
    meta = PagedAttentionMetadata.build([q for q, _ in rows], [c for _, c in rows], tables, block_size)
    n = meta.num_tokens
    # Every slot starts random, so a read of an unmasked wrong slot changes the output.
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    tensors = [
        torch.randn(n, num_heads, head_dim, generator=g),
        torch.randn(n, num_kv_heads, head_dim, generator=g),
        torch.randn(n, num_kv_heads, head_dim, generator=g),
        torch.randn(cache_shape, generator=g),
        torch.randn(cache_shape, generator=g),
    ]
    return meta, [t.to(dtype) for t in tensors]


def naive_slots(rows: list[Row], tables: list[list[int]], block_size: int) -> list[int]:
    slots = []
    for (query_len, context_len), table in zip(rows, tables, strict=True):
        for p in range(context_len, context_len + query_len):
            slots.append(table[p // block_size] * block_size + p % block_size)
    return slots


def run_backend(
    meta: PagedAttentionMetadata, tensors: list[torch.Tensor], heads: tuple[int, int, int], use_kernel: bool
) -> torch.Tensor:
    """The CPU backend's output, through the extension's paged kernel or through SDPA only."""
    q, k, v, k_cache, v_cache = tensors
    backend = TorchAttentionBackend(*heads, q.dtype, use_kernel=use_kernel)
    assert backend.use_kernel == use_kernel  # the extension builds wherever the tests run
    backend.plan(meta)
    return backend.forward(q, k, v, k_cache, v_cache)


KERNEL = pytest.mark.parametrize("use_kernel", [False, True], ids=["sdpa", "kernel"])


# --- metadata --------------------------------------------------------------------------------


def test_build_lays_out_rows() -> None:
    rows: list[Row] = [(4, 0), (3, 5), (1, 9), (1, 0)]
    tables = [[7], [2, 3], [9, 4, 1], [5]]
    meta = PagedAttentionMetadata.build([q for q, _ in rows], [c for _, c in rows], tables, block_size=4)
    assert meta.query_start_loc.tolist() == [0, 4, 7, 8, 9]
    assert meta.context_lens.tolist() == [0, 5, 9, 0] and meta.seq_lens.tolist() == [4, 8, 10, 1]
    assert meta.block_tables.tolist() == [[7, 0, 0], [2, 3, 0], [9, 4, 1], [5, 0, 0]]
    assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert meta.slot_mapping.tolist() == naive_slots(rows, tables, 4)
    assert (meta.num_prefills, meta.num_prefill_tokens) == (2, 7)
    assert (meta.num_seqs, meta.num_tokens) == (4, 9)


def test_layout_arrays_stay_on_the_host() -> None:
    # plan() reads these on every step: built on the host, whatever the step's device.
    meta = PagedAttentionMetadata.build([3, 1], [2, 7], [[4, 1], [6, 2]], block_size=4, device="meta")
    host = (meta.query_start_loc, meta.context_lens, meta.seq_lens)
    csr = (meta.kv_indptr, meta.kv_indices, meta.last_page_len)
    assert all(t.device.type == "cpu" and t.dtype == torch.int32 for t in (*host, *csr))
    assert meta.block_tables.device.type == "meta" and meta.slot_mapping.device.type == "meta"


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_slot_mapping_matches_naive_loop(block_size: int) -> None:
    g = torch.Generator().manual_seed(block_size)
    tables, _ = make_layout(MIXED, block_size, g)
    meta = PagedAttentionMetadata.build([q for q, _ in MIXED], [c for _, c in MIXED], tables, block_size)
    assert meta.slot_mapping.tolist() == naive_slots(MIXED, tables, block_size)


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "tables", "match"),
    [
        ([1, 3], [0, 0], [[0], [1]], "must come before"),
        ([2, 1], [0, 0], [[0]], "one entry per row"),
        ([0], [0], [[0]], "query_len >= 1"),
        ([1], [-1], [[0]], "context_len >= 0"),
        ([3, 1], [2, 0], [[0], [1]], "row 0: 1 blocks of 4 cannot hold 5 tokens"),
    ],
)
def test_build_rejects_bad_layouts(
    query_lens: list[int], context_lens: list[int], tables: list[list[int]], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        PagedAttentionMetadata.build(query_lens, context_lens, tables, block_size=4)


def test_build_lists_pages_in_use_as_csr() -> None:
    meta = PagedAttentionMetadata.build([5, 1, 1], [0, 8, 3], [[3, 8, 6], [1, 2, 4], [7]], block_size=4)
    kv_indptr, kv_indices, last_page_len = meta.kv_indptr, meta.kv_indices, meta.last_page_len
    # seq_lens 5, 9, 4 -> 2, 3 and 1 pages; the spare page 6 of row 0 is not in use.
    assert kv_indptr.tolist() == [0, 2, 5, 6]
    assert kv_indices.tolist() == [3, 8, 1, 2, 4, 7]
    assert last_page_len.tolist() == [1, 1, 4]
    assert {t.dtype for t in (kv_indptr, kv_indices, last_page_len)} == {torch.int32}


# --- CPU backend vs reference -----------------------------------------------------------------


CASES: dict[str, list[Row]] = {
    "mixed": MIXED,
    "single_decode": [(1, 40)],
    "only_prefill": [(12, 0), (6, 20), (2, 1)],
    "only_decode": [(1, 0), (1, 5), (1, 100), (1, 63)],
    # several decode groups (lengths far apart), rows of one group not adjacent in the batch
    "decodes_far_apart": [(5, 30), (1, 2), (1, 1200), (1, 9), (1, 3000), (1, 40), (1, 1100)],
    "prefill_without_context": [(33, 0)],
    # decodes verifying drafts (short rows with context): batched, padded in queries and keys; the
    # row one token past the bound and those with many keys take their own SDPA
    "verification_rows": [(6, 30), (2, 700), (16, 5), (3, 2), (17, 40), (4, 2900), (1, 17), (1, 300)],
    "verification_groups": [(6, 30), (2, 200), (16, 5), (3, 2), (1, 17), (1, 300)],
}


@KERNEL
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_backend_matches_reference_fp32(case: str, block_size: int, use_kernel: bool) -> None:
    meta, tensors = random_step(CASES[case], block_size, SMOLLM2, torch.float32, seed=block_size)
    out = run_backend(meta, tensors, SMOLLM2, use_kernel)
    q, _, _, k_cache, v_cache = tensors  # caches now hold the step's k/v
    expected = paged_attention_reference(q, k_cache, v_cache, meta)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@KERNEL
@pytest.mark.parametrize("heads", [(4, 4, 32), (8, 2, 16), (6, 1, 64), (4, 2, 20)])
def test_cpu_backend_matches_reference_other_head_layouts(
    heads: tuple[int, int, int], use_kernel: bool
) -> None:
    # (4, 2, 20): a head_dim that is not a multiple of the kernel's vector width
    meta, tensors = random_step(MIXED, 16, heads, torch.float32, seed=7)
    out = run_backend(meta, tensors, heads, use_kernel)
    torch.testing.assert_close(out, paged_attention_reference(tensors[0], tensors[3], tensors[4], meta))


@KERNEL
@pytest.mark.parametrize("block_size", [1, 16])
def test_cpu_backend_matches_reference_bf16(block_size: int, use_kernel: bool) -> None:
    meta, tensors = random_step(MIXED, block_size, SMOLLM2, torch.bfloat16, seed=3)
    out = run_backend(meta, tensors, SMOLLM2, use_kernel)
    expected = paged_attention_reference(tensors[0], tensors[3], tensors[4], meta)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)
    assert (out.float() - expected.float()).abs().mean() < 3e-3


def test_decode_rows_group_by_length_within_twice_the_shortest_plus_slack() -> None:
    slack = DECODE_GROUP_SLACK_TOKENS
    assert decode_groups([]) == []
    assert decode_groups([16, 64, 32]) == [[0, 1, 2]]  # the usual step: one group, in order
    lens = [16, 4000, 48, 2 * 48 + slack + 16, 4096]
    assert decode_groups(lens) == [[0, 2], [3], [1, 4]]
    assert decode_groups([2 * 16 + slack, 16]) == [[0, 1]]  # the bound itself still fits


def test_cache_written_at_slots_and_nowhere_else() -> None:
    # (the kernel path: the extension reads the pages in place after the write)
    meta, tensors = random_step(MIXED, 16, SMOLLM2, torch.float32, seed=11)
    _, k, v, k_cache, v_cache = tensors
    k_before, v_before = k_cache.clone(), v_cache.clone()
    run_backend(meta, tensors, SMOLLM2, use_kernel=True)
    slots = meta.slot_mapping
    flat_k, flat_v = k_cache.view(-1, 3, 64), v_cache.view(-1, 3, 64)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], k_before.view(-1, 3, 64)[untouched])
    assert torch.equal(flat_v[untouched], v_before.view(-1, 3, 64)[untouched])


def test_short_rows_with_context_share_sdpas_and_long_ones_do_not() -> None:
    meta, _ = random_step(CASES["verification_rows"], 16, SMOLLM2, torch.float32)
    backend = TorchAttentionBackend(*SMOLLM2, torch.float32)
    backend.plan(meta)
    # (17, 40): one token past the bound; (2, 700) and (4, 2900): keys past MAX_SHORT_KEYS
    assert [(r.start, r.end) for r in backend._prefills] == [(6, 8), (27, 44), (44, 48)]
    # (rows, queries per row): the short rows padded to their longest (16, 32, 48 keys: one
    # group), then the decodes' one batch with a query each
    assert [(b.num_rows, b.query_len) for b in backend._batches] == [(3, 16), (2, 1)]


def test_kernel_takes_decodes_and_short_rows_and_sdpa_the_long_prefills() -> None:
    meta, _ = random_step(CASES["verification_rows"], 16, SMOLLM2, torch.float32)
    backend = TorchAttentionBackend(*SMOLLM2, torch.float32, use_kernel=True)
    backend.plan(meta)
    assert backend._kernel is not None and backend._batches == []
    # (17, 40) is one token past MAX_SHORT_QUERY_LEN: SDPA's; every other row is the kernel's
    assert [(r.start, r.end) for r in backend._prefills] == [(27, 44)]
    kernel_tokens = set(backend._kernel.token_index.tolist())
    assert kernel_tokens == set(range(meta.num_tokens)) - set(range(27, 44))
    # a decode row sees its whole sequence; a short row's tokens see up to themselves
    first_row = backend._kernel.token_num_keys[:6].tolist()
    assert first_row == list(range(31, 37)) and backend._kernel.token_num_keys[-1] == 301


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_refuses_indices_out_of_range(dtype: torch.dtype) -> None:
    meta, (q, _, _, k_cache, v_cache) = random_step([(1, 30)], 16, SMOLLM2, dtype)
    ops = cpu_ext.ops()
    assert ops is not None
    out = torch.empty_like(q)
    tables = meta.block_tables.clone()
    good = [
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([31], dtype=torch.int32),
    ]
    ops.paged_attention(out, q, k_cache, v_cache, tables, *good, 0.125)
    for bad in (
        [
            good[0],
            good[1],
            torch.tensor([tables.shape[1] * 16 + 1], dtype=torch.int32),
        ],  # more keys than pages
        [torch.tensor([5], dtype=torch.int32), good[1], good[2]],  # no such token
        [good[0], torch.tensor([1], dtype=torch.int32), good[2]],  # no such row
    ):
        with pytest.raises(RuntimeError, match="out of range"):
            ops.paged_attention(out, q, k_cache, v_cache, tables, *bad, 0.125)
    tables[0, 0] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_attention(out, q, k_cache, v_cache, tables, *good, 0.125)


def test_decode_padding_over_zeroed_cache_is_finite() -> None:
    # The owner zero-initialises the cache: a short row padded to a long one reads zeros, masked.
    rows: list[Row] = [(1, 0), (1, 200)]
    meta, tensors = random_step(rows, 16, SMOLLM2, torch.float32)
    tensors[3].zero_()
    tensors[4].zero_()
    out = run_backend(meta, tensors, SMOLLM2, use_kernel=False)
    assert torch.isfinite(out).all()
    # A one-token sequence attends only to itself: the output is its own value, per KV head.
    v_own = tensors[2][0].repeat_interleave(3, dim=0)
    torch.testing.assert_close(out[0], v_own)


def test_chunked_prefill_equals_whole_prefill() -> None:
    num_heads, num_kv_heads, head_dim = SMOLLM2
    g = torch.Generator().manual_seed(5)
    total, block_size, table = 41, 16, [6, 2, 9]
    q = torch.randn(total, num_heads, head_dim, generator=g)
    k = torch.randn(total, num_kv_heads, head_dim, generator=g)
    v = torch.randn(total, num_kv_heads, head_dim, generator=g)
    # A decode row of another sequence rides along in every chunk's step.
    other_k = torch.randn(12 * block_size, num_kv_heads, head_dim, generator=g)

    def step(chunks: list[tuple[int, int]]) -> torch.Tensor:
        k_cache = torch.zeros(12, block_size, num_kv_heads, head_dim)
        v_cache = torch.zeros_like(k_cache)
        backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, torch.float32)
        outs = []
        for start, end in chunks:
            meta = PagedAttentionMetadata.build([end - start, 1], [start, 30], [table, [11, 0]], block_size)
            backend.plan(meta)
            qs = torch.cat([q[start:end], q[:1]])
            ks, vs = torch.cat([k[start:end], other_k[:1]]), torch.cat([v[start:end], other_k[1:2]])
            outs.append(backend.forward(qs, ks, vs, k_cache, v_cache)[: end - start])
        return torch.cat(outs)

    whole = step([(0, total)])
    torch.testing.assert_close(step([(0, 15), (15, 27), (27, total)]), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step([(0, 16), (16, total)]), whole, atol=1e-5, rtol=1e-5)
    # The whole prefill itself is plain causal attention over the sequence.
    k_rep, v_rep = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k_rep) / head_dim**0.5
    scores.masked_fill_(torch.ones(total, total, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(whole, torch.einsum("hqk,khd->qhd", scores.softmax(-1), v_rep))


def test_backend_is_reused_across_layers_and_steps() -> None:
    # One plan serves several layers (distinct caches); a new plan replaces the old layout.
    backend = TorchAttentionBackend(*SMOLLM2, torch.float32)
    for seed, rows in enumerate([MIXED, [(1, 5), (1, 70)]]):
        meta, _ = random_step(rows, 16, SMOLLM2, torch.float32, seed=seed)
        backend.plan(meta)
        for layer in range(2):
            _, (q, k, v, k_cache, v_cache) = random_step(
                rows, 16, SMOLLM2, torch.float32, seed=10 * seed + layer
            )
            out = backend.forward(q, k, v, k_cache, v_cache)
            torch.testing.assert_close(out, paged_attention_reference(q, k_cache, v_cache, meta))


def test_forward_needs_plan_and_planned_dtype() -> None:
    meta, (q, k, v, k_cache, v_cache) = random_step([(1, 4)], 16, SMOLLM2, torch.float32)
    backend = TorchAttentionBackend(*SMOLLM2, torch.bfloat16)
    with pytest.raises(RuntimeError, match="plan"):
        backend.forward(q, k, v, k_cache, v_cache)
    backend.plan(meta)
    with pytest.raises(ValueError, match="bfloat16"):
        backend.forward(q, k, v, k_cache, v_cache)


def test_make_attention_backend_on_cpu() -> None:
    backend = make_attention_backend(torch.device("cpu"), *SMOLLM2, torch.float32)
    assert isinstance(backend, TorchAttentionBackend) and backend.use_kernel
    with pytest.raises(ValueError, match="multiple"):
        make_attention_backend(torch.device("cpu"), 9, 2, 64, torch.float32)


# --- CUDA -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["mixed", "only_prefill", "only_decode", "single_decode"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_flashinfer_backend_matches_reference(case: str, block_size: int) -> None:
    pytest.importorskip("flashinfer")
    meta_cpu, tensors = random_step(CASES[case], block_size, SMOLLM2, torch.bfloat16, seed=block_size)
    rows = CASES[case]
    tables = meta_cpu.block_tables.tolist()
    meta = PagedAttentionMetadata.build(
        [q for q, _ in rows], [c for _, c in rows], tables, block_size, device="cuda"
    )
    q, k, v, k_cache, v_cache = (t.cuda() for t in tensors)
    backend = make_attention_backend(torch.device("cuda"), *SMOLLM2, torch.bfloat16)
    assert not isinstance(backend, TorchAttentionBackend)
    backend.plan(meta)
    out = backend.forward(q, k, v, k_cache, v_cache)
    assert torch.equal(k_cache.view(-1, 3, 64)[meta.slot_mapping], k)
    expected = paged_attention_reference(q, k_cache, v_cache, meta)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_extensions_kv_write_is_index_copy(dtype: torch.dtype) -> None:
    """write_kv on the CPU is one extension op: the same pages as two index_copy_ (the torch path),
    from k/v that are strided views into a fused qkv output."""
    ops = cpu_ext.ops()
    assert ops is not None
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 9 * 8 + 2 * 3 * 8, generator=g).to(dtype)
    k, v = qkv[:, 72:96].view(5, 3, 8), qkv[:, 96:].view(5, 3, 8)
    slots = torch.tensor([0, 7, 8, 30, 31])
    caches = [torch.zeros(4, 8, 3, 8, dtype=dtype) for _ in range(4)]
    ops.write_kv(k, v, caches[0], caches[1], slots)
    caches[2].view(-1, 3, 8).index_copy_(0, slots, k)
    caches[3].view(-1, 3, 8).index_copy_(0, slots, v)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.write_kv(k, v, caches[0], caches[1], torch.tensor([0, 1, 2, 3, 32]))
    with pytest.raises(RuntimeError, match="int64"):
        ops.write_kv(k, v, caches[0], caches[1], slots.int())
