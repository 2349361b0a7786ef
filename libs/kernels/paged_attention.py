"""Attention over a paged KV cache for one step's flat batch of rows: metadata, backends, reference.

Cache layout per layer (flashinfer's NHD): k_cache, v_cache are [num_blocks, block_size,
num_kv_heads, head_dim]. Position p of a sequence lives in block `block_table[p // block_size]` at
offset `p % block_size`; its flat slot is `block_id * block_size + offset`. A step's rows are
prefill rows (query_len > 1) first, then decode rows (query_len == 1). Each new token attends
causally to its row's cached context plus the row's new tokens up to itself; query head h reads
KV head h // (num_heads // num_kv_heads), with scale head_dim ** -0.5.

Backends: `TorchAttentionBackend` here (the CPU path; plain torch, so it also serves fp32 on
CUDA) and `FlashInferAttentionBackend` in paged_attention_flashinfer.py (CUDA, fp16/bf16).
`paged_attention_reference` is the per-row loop both are tested against: it gathers each row's
keys and runs the cacheless `libs.kernels.attention.causal_attention` over them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from libs.kernels import flashinfer_available
from libs.kernels.attention import causal_attention


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """One step's batch layout. Rows with query_len > 1 come first, then rows with query_len == 1
    (decodes). A row computes `query_len` new tokens after `context_len` tokens already cached.

    The layout arrays stay on the host (CPU, int32), computed once in build() from the host lists:
    plan() reads only them, so planning never copies from the device (a sync per read on CUDA).
    Only what forward() indexes with goes to the step's device.
    """

    # On the host, int32.
    query_start_loc: Tensor  # [num_seqs + 1] cumulative query lengths
    context_lens: Tensor  # [num_seqs]
    seq_lens: Tensor  # [num_seqs] = context + query
    # The pages in use (flashinfer's CSR form): row r uses pages kv_indices[kv_indptr[r] :
    # kv_indptr[r + 1]] in position order and holds last_page_len[r] (1..block_size) tokens in the last.
    kv_indptr: Tensor  # [num_seqs + 1]
    kv_indices: Tensor  # [total pages in use]
    last_page_len: Tensor  # [num_seqs]
    # On the step's device.
    block_tables: Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    slot_mapping: Tensor  # [num_tokens] int64: cache slot of every new token
    num_prefills: int  # leading rows with query_len > 1
    num_prefill_tokens: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> PagedAttentionMetadata:
        """Validate one step's rows and lay them out: host arrays, and tensors on `device`.

        Raises ValueError when the lists disagree in length, a query_len is < 1, a context_len
        is < 0, a multi-token row follows a single-token row, or a block table is too short for
        its row's context + query tokens.
        """
        num_seqs = len(query_lens)
        if len(context_lens) != num_seqs or len(block_tables) != num_seqs:
            raise ValueError("query_lens, context_lens and block_tables must have one entry per row")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        q_lens = np.asarray(query_lens, dtype=np.int64).reshape(num_seqs)
        ctx_lens = np.asarray(context_lens, dtype=np.int64).reshape(num_seqs)
        if (q_lens < 1).any() or (ctx_lens < 0).any():
            raise ValueError("every row needs query_len >= 1 and context_len >= 0")
        is_prefill = q_lens > 1
        num_prefills = int(is_prefill.sum())
        if is_prefill[num_prefills:].any():
            raise ValueError("rows with query_len > 1 must come before rows with query_len == 1")
        seq_lens = ctx_lens + q_lens
        table_lens = np.asarray([len(t) for t in block_tables], dtype=np.int64).reshape(num_seqs)
        short = np.flatnonzero(table_lens * block_size < seq_lens)
        if short.size:
            row = int(short[0])
            raise ValueError(
                f"row {row}: {table_lens[row]} blocks of {block_size} cannot hold {seq_lens[row]} tokens"
            )

        max_blocks = int(table_lens.max(initial=0))
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        tables[np.arange(max_blocks)[None, :] < table_lens[:, None]] = [b for t in block_tables for b in t]
        query_start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start[1:])
        # Every new token's row and absolute position, then its slot: no per-token Python loop.
        num_tokens = int(query_start[-1])
        token_row = np.repeat(np.arange(num_seqs), q_lens)
        positions = np.arange(num_tokens) - query_start[token_row] + ctx_lens[token_row]
        slots = tables[token_row, positions // block_size] * block_size + positions % block_size
        # Pages in use: seq_len >= 1, so every row has at least one.
        num_pages = (seq_lens + block_size - 1) // block_size
        kv_indptr = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_pages, out=kv_indptr[1:])
        # Boolean indexing is row-major: rows concatenated, each row's pages in position order.
        kv_indices = tables[np.arange(max_blocks)[None, :] < num_pages[:, None]]
        last_page_len = seq_lens - (num_pages - 1) * block_size

        def on_host(a: np.ndarray[Any, Any]) -> Tensor:
            return torch.from_numpy(a).to(torch.int32)

        def on_device(a: np.ndarray[Any, Any], dtype: torch.dtype) -> Tensor:
            return torch.from_numpy(a).to(device=device, dtype=dtype)

        return cls(
            query_start_loc=on_host(query_start),
            context_lens=on_host(ctx_lens),
            seq_lens=on_host(seq_lens),
            kv_indptr=on_host(kv_indptr),
            kv_indices=on_host(kv_indices),
            last_page_len=on_host(last_page_len),
            block_tables=on_device(tables, torch.int32),
            slot_mapping=on_device(slots, torch.int64),
            num_prefills=num_prefills,
            num_prefill_tokens=int(query_start[num_prefills]),
            block_size=block_size,
        )


class AttentionBackend(Protocol):
    """Paged attention for every layer of one step: plan once, then forward once per layer."""

    def plan(self, meta: PagedAttentionMetadata) -> None:
        """Prepare the step's layout (indices, masks, kernel schedules) shared by all layers."""
        ...

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """Write the step's k/v at the planned slots, then attend.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (rope
        applied); k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in
        place. Returns [num_tokens, num_heads, head_dim] in q.dtype.
        """
        ...


def make_attention_backend(
    device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> AttentionBackend:
    """flashinfer on CUDA for fp16/bf16 where it is installed (it has no fp32 kernels); plain torch
    otherwise, on any device."""
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    device = torch.device(device)
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flashinfer_available():
        # Imported here: that module imports this one, and flashinfer itself is CUDA-only.
        from libs.kernels.paged_attention_flashinfer import FlashInferAttentionBackend

        return FlashInferAttentionBackend(device, num_heads, num_kv_heads, head_dim, dtype)
    return TorchAttentionBackend(num_heads, num_kv_heads, head_dim, dtype)


def decode_groups(padded_lens: list[int]) -> list[list[int]]:
    """Decode rows (by their padded lengths in tokens) in groups that share one SDPA: from the
    shortest up, a row joins the current group while it is at most twice the group's shortest
    plus DECODE_GROUP_SLACK_TOKENS. Each group lists row indices in ascending order; one group
    when every row fits (the usual step)."""
    order = sorted(range(len(padded_lens)), key=lambda i: padded_lens[i])
    groups: list[list[int]] = []
    bound = -1
    for i in order:
        if padded_lens[i] > bound:
            groups.append([])
            bound = 2 * padded_lens[i] + DECODE_GROUP_SLACK_TOKENS
        groups[-1].append(i)
    return [sorted(g) for g in groups]


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Store the step's new k/v ([num_tokens, num_kv_heads, head_dim]) at their flat cache slots."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention_reference(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMetadata
) -> Tensor:
    """Row by row, in fp32: gather the row's keys and values by position, then the cacheless
    causal attention of libs.kernels.attention (its last query aligned with the last key: the
    context-offset causal mask; KV head h // group serves query head h). The caches must already
    hold the step's new k/v.

    q: [num_tokens, num_heads, head_dim]; returns [num_tokens, num_heads, head_dim] in q.dtype.
    """
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    tables = meta.block_tables.tolist()
    for row, seq_len in enumerate(meta.seq_lens.tolist()):
        positions = torch.arange(seq_len, device=q.device)
        blocks = torch.tensor(tables[row], dtype=torch.long, device=q.device)[positions // meta.block_size]
        offsets = positions % meta.block_size
        keys = k_cache[blocks, offsets]  # [seq_len, num_kv_heads, head_dim]
        values = v_cache[blocks, offsets]
        queries = q[starts[row] : starts[row + 1]]  # [query_len, num_heads, head_dim]
        attended = causal_attention(queries.float(), keys.float(), values.float())
        out[starts[row] : starts[row + 1]] = attended.to(q.dtype)
    return out


@dataclass(frozen=True)
class _PrefillRow:
    start: int  # first token of the row in the step's flat batch
    end: int
    kv_index: Tensor | None  # gather index (see _kv_index) over the row's pages; None: no context
    mask: Tensor | None  # [query_len, padded_len] additive (0 / -inf), padded_len = blocks * block_size


# Decode rows of similar length share one padded SDPA: a row joins the group of the shortest rows
# while its length stays within 2x theirs plus this slack (in tokens). Padding every row to the
# longest one made a batch of short streams beside one 4k-token row cost 20x its keys' work.
DECODE_GROUP_SLACK_TOKENS = 256


@dataclass(frozen=True)
class _DecodeBatch:
    start: int  # first decode token = num_prefill_tokens
    num_rows: int
    kv_index: Tensor  # gather index (see _kv_index) over the group's rows' pages, padded
    mask: Tensor  # [num_rows, 1, 1, padded_len] additive (0 / -inf)
    token_index: Tensor | None  # the group's rows in the step's flat batch; None: every decode row


class TorchAttentionBackend:
    """The CPU backend: plain torch, SDPA's fused CPU kernel, no per-token Python work.

    Decode rows are batched SDPAs, one per group of rows of similar length (most steps: one):
    each row's keys are gathered and padded to the group's longest row; padded keys read real,
    finite cache slots and are masked out, and no row is fully masked (seq_len >= 1), so padding
    never yields NaN. The query group of a KV head is folded into SDPA's
    query-length dim ([rows, kv_heads, group, head_dim]): decode has no causal structure, so this
    is exact, and it avoids SDPA's slower grouped-query route. Prefill rows (few, compute-bound)
    loop: a row without context attends over its own new k/v with `is_causal`; a row with context
    gathers its keys and uses the offset causal mask from plan().

    Gathers are head-major ([rows, kv_heads, padded_len, head_dim], contiguous), which SDPA reads
    about twice as fast as a transposed view of the cache's token-major pages, and they land in
    two buffers kept across layers and steps (grown, never shrunk): a fresh multi-megabyte tensor
    per layer costs more in page faults than the copy itself.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype = dtype
        self.scale = head_dim**-0.5
        self._meta: PagedAttentionMetadata | None = None
        self._prefills: list[_PrefillRow] = []
        self._decodes: list[_DecodeBatch] = []
        self._k_buf = torch.empty(0, head_dim, dtype=dtype)  # [gathered vectors, head_dim]
        self._v_buf = torch.empty(0, head_dim, dtype=dtype)

    def plan(self, meta: PagedAttentionMetadata) -> None:
        device = meta.block_tables.device
        block_size = meta.block_size
        # Row lengths come from the metadata's host arrays: no device read-back.
        starts = meta.query_start_loc.tolist()
        context_lens = meta.context_lens.tolist()
        num_pages = meta.kv_indptr.diff().tolist()  # [num_seqs] blocks in use
        tables = meta.block_tables.long()
        self._prefills = []
        for row in range(meta.num_prefills):
            start, end, context_len = starts[row], starts[row + 1], context_lens[row]
            if context_len == 0:
                self._prefills.append(_PrefillRow(start, end, None, None))
                continue
            padded_len = num_pages[row] * block_size
            key_pos = torch.arange(padded_len, device=device)
            query_pos = context_len + torch.arange(end - start, device=device)
            # Keys past seq_len are beyond every query position, so the causal test masks them too.
            mask = self._additive(key_pos[None, :] <= query_pos[:, None])
            kv_index = self._kv_index(tables[row : row + 1], padded_len, block_size)
            self._prefills.append(_PrefillRow(start, end, kv_index, mask))
        first = meta.num_prefills
        groups = decode_groups([n * block_size for n in num_pages[first:]])
        self._decodes = []
        for group in groups:
            rows = [first + i for i in group]
            padded_len = max(num_pages[r] for r in rows) * block_size
            index = torch.tensor(rows, device=device)
            kv_index = self._kv_index(tables[index], padded_len, block_size)
            seq_lens = meta.seq_lens[rows].to(device=device, dtype=torch.long)
            valid = torch.arange(padded_len, device=device)[None, :] < seq_lens[:, None]
            mask = self._additive(valid).view(len(rows), 1, 1, padded_len)
            # Decode row r's token sits at num_prefill_tokens + (r - num_prefills) in the flat batch.
            tokens = None if len(groups) == 1 else index + (meta.num_prefill_tokens - first)
            self._decodes.append(_DecodeBatch(meta.num_prefill_tokens, len(rows), kv_index, mask, tokens))
        self._reserve_buffers(device)
        self._meta = meta

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        meta = self._meta
        if meta is None:
            raise RuntimeError("forward() before plan()")
        if q.dtype != self.dtype:
            raise ValueError(f"backend planned for {self.dtype}, got q in {q.dtype}")
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        k_vectors = k_cache.view(-1, self.head_dim)  # [num_slots * num_kv_heads, head_dim]
        v_vectors = v_cache.view(-1, self.head_dim)
        for row in self._prefills:
            out[row.start : row.end] = self._prefill_row(row, q, k, v, k_vectors, v_vectors)
        for batch in self._decodes:
            if batch.token_index is None:
                out[batch.start :] = self._decode_rows(batch, q[batch.start :], k_vectors, v_vectors)
            else:
                queries = q.index_select(0, batch.token_index)
                out[batch.token_index] = self._decode_rows(batch, queries, k_vectors, v_vectors)
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
            keys = self._gather(
                k_vectors, row.kv_index, 1, self._k_buf
            )  # [1, kv_heads, padded_len, head_dim]
            values = self._gather(v_vectors, row.kv_index, 1, self._v_buf)
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=row.mask, scale=self.scale, enable_gqa=True
            )
        return out[0].transpose(0, 1)

    def _decode_rows(self, batch: _DecodeBatch, q: Tensor, k_vectors: Tensor, v_vectors: Tensor) -> Tensor:
        """One group's decode rows' outputs at once (``q``: their queries, [num_rows, num_heads,
        head_dim]), [num_rows, num_heads, head_dim]."""
        group = self.num_heads // self.num_kv_heads
        # [num_rows, num_kv_heads, group, head_dim]: query head h = kv_head * group + g.
        queries = q.reshape(batch.num_rows, self.num_kv_heads, group, self.head_dim)
        keys = self._gather(k_vectors, batch.kv_index, batch.num_rows, self._k_buf)  # [rows, kv, padded, d]
        values = self._gather(v_vectors, batch.kv_index, batch.num_rows, self._v_buf)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=batch.mask, scale=self.scale)
        return out.reshape(batch.num_rows, self.num_heads, self.head_dim)

    def _kv_index(self, tables: Tensor, padded_len: int, block_size: int) -> Tensor:
        """Gather index, head-major: entry (row, kv_head, j) is the cache vector (in the cache seen as
        [num_slots * num_kv_heads, head_dim]) of position j of the row at that head.

        tables: [rows, >= padded_len / block_size] int64. Returns [rows * num_kv_heads * padded_len]
        int64. Positions past a row's seq_len read other real slots (spare or padding blocks).
        """
        pos = torch.arange(padded_len, device=tables.device)
        slots = tables[:, pos // block_size] * block_size + pos % block_size  # [rows, padded_len]
        heads = torch.arange(self.num_kv_heads, device=tables.device)
        return (slots[:, None, :] * self.num_kv_heads + heads[None, :, None]).reshape(-1)

    def _gather(self, vectors: Tensor, kv_index: Tensor, num_rows: int, buf: Tensor) -> Tensor:
        """[num_rows, num_kv_heads, padded_len, head_dim], contiguous, in buf's memory."""
        gathered = buf[: kv_index.numel()]
        torch.index_select(vectors, 0, kv_index, out=gathered)
        return gathered.view(num_rows, self.num_kv_heads, -1, self.head_dim)

    def _reserve_buffers(self, device: torch.device) -> None:
        """Grow the gather buffers to the step's largest gather (one prefill row's, or the decodes')."""
        indices = [r.kv_index for r in self._prefills if r.kv_index is not None]
        indices += [batch.kv_index for batch in self._decodes]
        size = max((int(i.numel()) for i in indices), default=0)
        if self._k_buf.device == device and self._k_buf.shape[0] >= size:
            return
        self._k_buf = torch.empty(size, self.head_dim, dtype=self.dtype, device=device)
        self._v_buf = torch.empty(size, self.head_dim, dtype=self.dtype, device=device)

    def _additive(self, allowed: Tensor) -> Tensor:
        """0 where allowed, -inf elsewhere, in the compute dtype (SDPA adds it to the scores)."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, float("-inf"))
