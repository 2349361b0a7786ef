"""The plain-torch paged attention backend (the CPU path; it also serves fp32 on CUDA): rows in
batched SDPAs where they are short, one SDPA per long prefill row. Layout and reference:
paged_attention.py."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from libs.kernels import cpu_ext
from libs.kernels.decoder_blocks import PagedKernelStep
from libs.kernels.paged_attention import PagedAttentionMetadata, write_kv

# Rows of similar length share one padded SDPA: a row joins the group of the shortest rows while
# its length stays within 2x theirs plus this slack (in tokens). Padding every row to the longest
# one made a batch of short streams beside one 4k-token row cost 20x its keys' work.
DECODE_GROUP_SLACK_TOKENS = 256
# A row with context and at most this many new tokens (a decode verifying its drafts) is batched
# like decodes, padded to its group's longest such row, instead of taking its own SDPA, if its
# keys fit in MAX_SHORT_KEYS: past that the SDPA is compute-bound and batching saves nothing
# (measured: 32 rows of 6 queries at 200 keys 2.1x faster batched, at 640 keys 5% slower).
MAX_SHORT_QUERY_LEN = 16
MAX_SHORT_KEYS = 512
SHORT_GROUPING = (1.25, 32)  # (factor, slack) of their groups: see decode_groups


def decode_groups(padded_lens: list[int], factor: float = 2.0, slack: int | None = None) -> list[list[int]]:
    """Rows (by their padded lengths in tokens) in groups that share one SDPA: from the shortest
    up, a row joins the current group while it is at most ``factor`` times the group's shortest
    plus ``slack`` (DECODE_GROUP_SLACK_TOKENS). Each group lists row indices in ascending order;
    one group when every row fits (the usual step)."""
    slack = DECODE_GROUP_SLACK_TOKENS if slack is None else slack
    order = sorted(range(len(padded_lens)), key=lambda i: padded_lens[i])
    groups: list[list[int]] = []
    bound = -1.0
    for i in order:
        if padded_lens[i] > bound:
            groups.append([])
            bound = factor * padded_lens[i] + slack
        groups[-1].append(i)
    return [sorted(g) for g in groups]


@dataclass(frozen=True)
class _PrefillRow:
    start: int  # first token of the row in the step's flat batch
    end: int
    kv_index: Tensor | None  # gather index (see HeadMajorGather.index) over the row's pages; None: no context
    mask: Tensor | None  # [query_len, padded_len] additive (0 / -inf), padded_len = blocks * block_size


@dataclass(frozen=True)
class _RowBatch:
    """Rows sharing one SDPA: decodes (query_len 1), or short rows with context, each padded to
    the group's longest row in keys and in queries (a shorter row repeats its last query)."""

    start: int  # first token of the batch's part of the flat batch (its decodes: num_prefill_tokens)
    num_rows: int
    query_len: int  # queries per row
    kv_index: Tensor  # gather index (see HeadMajorGather.index) over the group's rows' pages, padded
    mask: Tensor  # [num_rows, 1, 1 or query_len * group, padded_len] additive (0 / -inf)
    # [num_rows * query_len] flat tokens read as queries; None: q[start:] as it is
    query_index: Tensor | None
    out_index: Tensor | None  # of the batch's num_rows * query_len outputs, the real ones; None: all
    token_index: Tensor | None  # where those go in the flat batch; None: out[start:]


KERNEL_DTYPES = (torch.float32, torch.bfloat16)
KERNEL_MAX_GROUP = 64  # query heads per KV head the kernel takes (MAX_GROUP in cpu_ops.cpp)


def kernel_ops(num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> Any:
    """The CPU extension's ops (torch.ops.deepinfer_cpu) when it is built and its paged kernel
    takes this dtype and query group; else None."""
    fits = dtype in KERNEL_DTYPES and num_heads // num_kv_heads <= KERNEL_MAX_GROUP
    return cpu_ext.ops() if fits else None


@dataclass(frozen=True)
class KernelTokens:
    """The step's tokens that the extension's ``paged_attention`` computes: every token of a
    decode row or of a short row with context (at most MAX_SHORT_QUERY_LEN new tokens), each
    with its row and the number of the row's first keys it sees (causal)."""

    ops: Any  # torch.ops.deepinfer_cpu, as the backend found it built
    block_tables: Tensor  # [num_seqs, max_num_blocks] int32
    token_index: Tensor  # [n] int32, flat token positions
    token_row: Tensor  # [n] int32
    token_num_keys: Tensor  # [n] int32

    @classmethod
    def plan(cls, meta: PagedAttentionMetadata, ops: Any, every_token: bool = False) -> KernelTokens | None:
        """``every_token``: prefill rows too, however long (the batch-invariant backend's plan)."""
        if meta.block_tables.device.type != "cpu":
            return None
        starts = meta.query_start_loc.tolist()
        context_lens = meta.context_lens.tolist()
        index: list[int] = []
        rows: list[int] = []
        num_keys: list[int] = []
        for row, context_len in enumerate(context_lens):
            start, end = starts[row], starts[row + 1]
            long_prefill = context_len == 0 or end - start > MAX_SHORT_QUERY_LEN
            if row < meta.num_prefills and long_prefill and not every_token:
                continue  # a prefill row: SDPA's
            index.extend(range(start, end))
            rows.extend([row] * (end - start))
            num_keys.extend(range(context_len + 1, context_len + 1 + end - start))
        if not index:
            return None

        def int32(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.int32)

        return cls(ops, meta.block_tables.contiguous(), int32(index), int32(rows), int32(num_keys))

    def run(self, out: Tensor, q: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float) -> None:
        self.ops.paged_attention(
            out,
            q.contiguous(),
            k_cache,
            v_cache,
            self.block_tables,
            self.token_index,
            self.token_row,
            self.token_num_keys,
            scale,
        )


class TorchAttentionBackend:
    """The CPU backend: plain torch, SDPA's fused CPU kernel, no per-token Python work.

    Decode rows are batched SDPAs, one per group of rows of similar length (most steps: one):
    each row's keys are gathered and padded to the group's longest row; padded keys read real,
    finite cache slots and are masked out, and no row is fully masked (seq_len >= 1), so padding
    never yields NaN. The query group of a KV head is folded into SDPA's query-length dim
    ([rows, kv_heads, group, head_dim]), which avoids SDPA's slower grouped-query route; the mask
    does not depend on the query head, so this is exact. Short rows with context (a decode and
    its drafts) batch the same way with [rows, kv_heads, query_len * group, head_dim] queries and
    each query's offset causal mask (while their keys are few: see MAX_SHORT_KEYS). Other prefill
    rows (few, compute-bound) loop: a row without
    context attends over its own new k/v with `is_causal`; a row with context gathers its keys
    and uses the offset causal mask from plan().

    Keys and values are gathered head-major (``HeadMajorGather``).

    With ``use_kernel`` (the worker's CPU backend, when the extension is built), decodes and short
    rows with context go to the extension's paged kernel instead (``KernelTokens``), which reads
    the pages in place; prefill rows keep the paths above.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, use_kernel: bool = False
    ) -> None:
        """``use_kernel``: CPU tensors only; taken when the extension is built and dtype fits."""
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype = dtype
        self.scale = head_dim**-0.5
        self._meta: PagedAttentionMetadata | None = None
        self._prefills: list[_PrefillRow] = []
        self._batches: list[_RowBatch] = []
        self._gather = HeadMajorGather(num_kv_heads, head_dim, dtype)
        # Decodes and short rows with context go to the CPU extension's paged kernel when it is
        # built (for fp32 / bf16): it reads each row's keys from the pages in place, with none of
        # the gather, mask and SDPA set-up, which cost more than the arithmetic at a few rows.
        self._ops = kernel_ops(num_heads, num_kv_heads, dtype) if use_kernel else None
        self.use_kernel = self._ops is not None
        self._kernel: KernelTokens | None = None

    def plan(self, meta: PagedAttentionMetadata) -> None:
        device = meta.block_tables.device
        block_size = meta.block_size
        self._kernel = KernelTokens.plan(meta, self._ops) if self._ops is not None else None
        # Row lengths come from the metadata's host arrays: no device read-back.
        starts = meta.query_start_loc.tolist()
        context_lens = meta.context_lens.tolist()
        num_pages = meta.kv_indptr.diff().tolist()  # [num_seqs] blocks in use
        tables = meta.block_tables.long()
        self._prefills, short = [], []
        for row in range(meta.num_prefills):
            start, end, context_len = starts[row], starts[row + 1], context_lens[row]
            if context_len == 0:
                self._prefills.append(_PrefillRow(start, end, None, None))
                continue
            padded_len = num_pages[row] * block_size
            if self._kernel is not None and end - start <= MAX_SHORT_QUERY_LEN:
                continue  # the kernel's
            if end - start <= MAX_SHORT_QUERY_LEN and padded_len <= MAX_SHORT_KEYS:
                short.append(row)
                continue
            key_pos = torch.arange(padded_len, device=device)
            query_pos = context_len + torch.arange(end - start, device=device)
            # Keys past seq_len are beyond every query position, so the causal test masks them too.
            mask = self._additive(key_pos[None, :] <= query_pos[:, None])
            kv_index = self._gather.index(tables[row : row + 1], padded_len, block_size)
            self._prefills.append(_PrefillRow(start, end, kv_index, mask))
        self._batches = []
        # Short rows are compute-bound (k + 1 queries each): their groups pad less than decodes'.
        for group in decode_groups([num_pages[r] * block_size for r in short], *SHORT_GROUPING):
            self._batches.append(self._short_batch(meta, [short[i] for i in group], tables))
        first = meta.num_prefills
        # Decodes are the kernel's when it runs.
        groups = (
            [] if self._kernel is not None else decode_groups([n * block_size for n in num_pages[first:]])
        )
        for group in groups:
            rows = [first + i for i in group]
            padded_len = max(num_pages[r] for r in rows) * block_size
            index = torch.tensor(rows, device=device)
            kv_index = self._gather.index(tables[index], padded_len, block_size)
            seq_lens = meta.seq_lens[rows].to(device=device, dtype=torch.long)
            valid = torch.arange(padded_len, device=device)[None, :] < seq_lens[:, None]
            mask = self._additive(valid).view(len(rows), 1, 1, padded_len)
            # Decode row r's token sits at num_prefill_tokens + (r - num_prefills) in the flat batch.
            tokens = None if len(groups) == 1 else index + (meta.num_prefill_tokens - first)
            batch = _RowBatch(meta.num_prefill_tokens, len(rows), 1, kv_index, mask, tokens, None, tokens)
            self._batches.append(batch)
        indices = [r.kv_index for r in self._prefills if r.kv_index is not None]
        self._gather.reserve([*indices, *(batch.kv_index for batch in self._batches)], device)
        self._meta = meta

    def kernel_step(self) -> PagedKernelStep | None:
        """The planned step as the paged kernel's arguments, when the kernel attends every one of
        its tokens (no row needs SDPA); else None."""
        if self._kernel is None or self._meta is None or self._prefills or self._batches:
            return None
        k = self._kernel
        slots = self._meta.slot_mapping
        return PagedKernelStep(slots, k.block_tables, k.token_index, k.token_row, k.token_num_keys)

    def _short_batch(self, meta: PagedAttentionMetadata, rows: list[int], tables: Tensor) -> _RowBatch:
        """Short rows with context as one batch: row r's query t is its token min(t, len_r - 1),
        which sees the keys up to its own position (context_len_r + that t)."""
        device = tables.device
        starts = meta.query_start_loc[rows].long()
        query_lens = meta.query_start_loc[[r + 1 for r in rows]].long() - starts
        context_lens = meta.context_lens[rows].long()
        query_len = int(query_lens.max())
        padded_len = int(meta.kv_indptr.diff()[rows].max()) * meta.block_size
        t = torch.arange(query_len)
        offsets = torch.minimum(t[None, :], query_lens[:, None] - 1)  # [rows, query_len]
        query_index = (starts[:, None] + offsets).reshape(-1)
        real = (t[None, :] < query_lens[:, None]).reshape(-1)
        out_index = torch.nonzero(real).reshape(-1)
        limits = context_lens[:, None] + offsets  # [rows, query_len]: the last key each query sees
        allowed = torch.arange(padded_len)[None, None, :] <= limits[:, :, None]
        group = self.num_heads // self.num_kv_heads
        # Queries fold as (t, g) -> t * group + g, as in _batch_rows.
        allowed = allowed[:, None, :, None, :].expand(-1, 1, -1, group, -1)
        allowed = allowed.reshape(len(rows), 1, query_len * group, padded_len)
        index = torch.tensor(rows, device=device)
        return _RowBatch(
            start=0,
            num_rows=len(rows),
            query_len=query_len,
            kv_index=self._gather.index(tables[index], padded_len, meta.block_size),
            mask=self._additive(allowed.to(device)),
            query_index=query_index.to(device),
            out_index=out_index.to(device),
            token_index=query_index[real].to(device),
        )

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        begin_forward(self._meta, self.dtype, q, k, v, k_cache, v_cache)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, as the kernel writes it
        if self._kernel is not None:
            self._kernel.run(out, q, k_cache, v_cache, self.scale)
        if not self._prefills and not self._batches:
            return out  # a step of decodes on the kernel: nothing read through SDPA
        k_vectors, v_vectors = cache_vectors(k_cache, v_cache)
        for row in self._prefills:
            out[row.start : row.end] = self._prefill_row(row, q, k, v, k_vectors, v_vectors)
        for batch in self._batches:
            queries = q[batch.start :] if batch.query_index is None else q.index_select(0, batch.query_index)
            attended = self._batch_rows(batch, queries, k_vectors, v_vectors)
            if batch.out_index is not None:
                attended = attended.index_select(0, batch.out_index)
            if batch.token_index is None:
                out[batch.start :] = attended
            else:
                out[batch.token_index] = attended
        return out

    def _prefill_row(
        self, row: _PrefillRow, q: Tensor, k: Tensor, v: Tensor, k_vectors: Tensor, v_vectors: Tensor
    ) -> Tensor:
        """One prefill row's output, [query_len, num_heads, head_dim]."""
        # SDPA's fused CPU kernel needs 4-D [batch, heads, len, head_dim]; 3-D takes the slow path.
        queries = q[row.start : row.end].transpose(0, 1).unsqueeze(0)  # [1, num_heads, query_len, head_dim]
        if row.kv_index is None:
            keys = k[row.start : row.end].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, query_len, head_dim]
            values = v[row.start : row.end].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            keys, values = self._gather(k_vectors, v_vectors, row.kv_index, 1)  # [1, kv_heads, padded, d]
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=row.mask, scale=self.scale, enable_gqa=True
            )
        return out[0].transpose(0, 1)

    def _batch_rows(self, batch: _RowBatch, q: Tensor, k_vectors: Tensor, v_vectors: Tensor) -> Tensor:
        """One batch's outputs (``q``: its queries, [num_rows * query_len, num_heads, head_dim]),
        [num_rows * query_len, num_heads, head_dim]."""
        n, t, group = batch.num_rows, batch.query_len, self.num_heads // self.num_kv_heads
        # Query head h = kv_head * group + g: [rows, t, kv_heads, group, d] -> [rows, kv_heads, t * group, d]
        queries = q.reshape(n, t, self.num_kv_heads, group, self.head_dim).transpose(1, 2)
        queries = queries.reshape(n, self.num_kv_heads, t * group, self.head_dim)
        keys, values = self._gather(k_vectors, v_vectors, batch.kv_index, n)  # [rows, kv, padded, d]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=batch.mask, scale=self.scale)
        out = out.view(n, self.num_kv_heads, t, group, self.head_dim).transpose(1, 2)
        return out.reshape(n * t, self.num_heads, self.head_dim)

    def _additive(self, allowed: Tensor) -> Tensor:
        """0 where allowed, -inf elsewhere, in the compute dtype (SDPA adds it to the scores)."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, float("-inf"))


def start_forward(
    meta: PagedAttentionMetadata | None,
    dtype: torch.dtype,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
) -> tuple[Tensor, Tensor]:
    """What a plain-torch backend's forward starts with: its plan and dtype checked, the step's
    k/v written; returns the caches as [num_slots * num_kv_heads, head_dim] vectors."""
    begin_forward(meta, dtype, q, k, v, k_cache, v_cache)
    return cache_vectors(k_cache, v_cache)


def begin_forward(
    meta: PagedAttentionMetadata | None,
    dtype: torch.dtype,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
) -> None:
    """start_forward without the vectors: the plan and dtype checked, the step's k/v written."""
    if meta is None:
        raise RuntimeError("forward() before plan()")
    if q.dtype != dtype:
        raise ValueError(f"backend planned for {dtype}, got q in {q.dtype}")
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)


def cache_vectors(k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
    """The caches [num_blocks, block_size, num_kv_heads, head_dim] as [num_slots * num_kv_heads,
    head_dim] vectors (views)."""
    head_dim = k_cache.shape[-1]
    return k_cache.view(-1, head_dim), v_cache.view(-1, head_dim)


class HeadMajorGather:
    """Rows' keys and values gathered from the paged cache head-major, [rows, kv_heads,
    padded_len, head_dim] contiguous, which SDPA reads about twice as fast as a transposed view of
    the cache's token-major pages. They land in two buffers kept across layers and steps (grown,
    never shrunk): a fresh multi-megabyte tensor per layer costs more in page faults than the copy."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self._k_buf = torch.empty(0, head_dim, dtype=dtype)  # [gathered vectors, head_dim]
        self._v_buf = torch.empty(0, head_dim, dtype=dtype)

    def index(self, tables: Tensor, padded_len: int, block_size: int) -> Tensor:
        """Gather index: entry (row, kv_head, j) is the cache vector (in the cache seen as
        [num_slots * num_kv_heads, head_dim]) of position j of the row at that head.

        tables: [rows, >= padded_len / block_size] int64. Returns [rows * num_kv_heads * padded_len]
        int64. Positions past a row's seq_len read other real slots (spare or padding blocks).
        """
        pos = torch.arange(padded_len, device=tables.device)
        slots = tables[:, pos // block_size] * block_size + pos % block_size  # [rows, padded_len]
        heads = torch.arange(self.num_kv_heads, device=tables.device)
        return (slots[:, None, :] * self.num_kv_heads + heads[None, :, None]).reshape(-1)

    def reserve(self, indices: Iterable[Tensor], device: torch.device) -> None:
        """Grow the buffers to the step's largest gather."""
        size = max((int(i.numel()) for i in indices), default=0)
        if self._k_buf.device == device and self._k_buf.shape[0] >= size:
            return
        self._k_buf = torch.empty(size, self.head_dim, dtype=self.dtype, device=device)
        self._v_buf = torch.empty(size, self.head_dim, dtype=self.dtype, device=device)

    def __call__(
        self, k_vectors: Tensor, v_vectors: Tensor, kv_index: Tensor, num_rows: int
    ) -> tuple[Tensor, Tensor]:
        """Keys and values at ``kv_index`` ([num_slots * num_kv_heads, head_dim] vectors), each
        [num_rows, num_kv_heads, padded_len, head_dim] in the buffers' memory (valid until the
        next call)."""
        out = []
        for vectors, buf in ((k_vectors, self._k_buf), (v_vectors, self._v_buf)):
            gathered = buf[: kv_index.numel()]
            torch.index_select(vectors, 0, kv_index, out=gathered)
            out.append(gathered.view(num_rows, self.num_kv_heads, -1, self.head_dim))
        return out[0], out[1]
