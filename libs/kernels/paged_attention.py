"""Attention over a paged KV cache for one step's flat batch of rows: metadata, backends, reference.

Cache layout per layer (flashinfer's NHD): k_cache, v_cache are [num_blocks, block_size,
num_kv_heads, head_dim]. Position p of a sequence lives in block `block_table[p // block_size]` at
offset `p % block_size`; its flat slot is `block_id * block_size + offset`. A step's rows are
prefill rows (query_len > 1) first, then decode rows (query_len == 1). Each new token attends
causally to its row's cached context plus the row's new tokens up to itself; query head h reads
KV head h // (num_heads // num_kv_heads), with scale head_dim ** -0.5.

Backends: `TorchAttentionBackend` in paged_attention_torch.py (the CPU path; plain torch, so it
also serves fp32 on CUDA), `FlashInferAttentionBackend` in paged_attention_flashinfer.py (CUDA,
fp16/bf16) and `BatchInvariantAttentionBackend` in paged_attention_invariant.py (`--deterministic`).
`paged_attention_reference` is the per-row loop both are tested against: it gathers each row's
keys and runs the cacheless `libs.kernels.attention.causal_attention` over them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from libs.kernels import cpu_ext, flashinfer_available
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
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    batch_invariant: bool = False,
) -> AttentionBackend:
    """flashinfer on CUDA for fp16/bf16 where it is installed (it has no fp32 kernels); plain torch
    otherwise, on any device. ``batch_invariant``: the backend whose outputs do not depend on the
    batch (paged_attention_invariant.py), on any device."""
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    device = torch.device(device)
    if batch_invariant:
        from libs.kernels.paged_attention_invariant import BatchInvariantAttentionBackend

        use_kernel = device.type == "cpu"
        return BatchInvariantAttentionBackend(num_heads, num_kv_heads, head_dim, dtype, use_kernel)
    # Imported here: both modules import this one (and flashinfer itself is CUDA-only).
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flashinfer_available():
        from libs.kernels.paged_attention_flashinfer import FlashInferAttentionBackend

        return FlashInferAttentionBackend(device, num_heads, num_kv_heads, head_dim, dtype)
    from libs.kernels.paged_attention_torch import TorchAttentionBackend

    return TorchAttentionBackend(num_heads, num_kv_heads, head_dim, dtype, use_kernel=device.type == "cpu")


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Store the step's new k/v ([num_tokens, num_kv_heads, head_dim]) at their flat cache slots.
    On the CPU one extension op does both (two index_copy_ on views cost ~25 us a layer)."""
    if k_cache.is_cpu and k.dtype == k_cache.dtype:
        ops = cpu_ext.ops()
        if ops is not None:
            ops.write_kv(k, v, k_cache, v_cache, slot_mapping)
            return
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
