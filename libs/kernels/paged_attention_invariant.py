"""Batch-invariant paged attention (``--deterministic``): a query's output depends on its own query
and keys only, never on the other rows of the step, how its prompt was chunked, or how far its
row's keys were padded. Layout and reference: paged_attention.py.

The CPU backend (paged_attention_torch.py) pads every row of a group to the group's longest and
runs SDPA, whose reductions over the keys change with that padded length: a decode's output then
depends on its batch mates. Here every reduction has a shape fixed by the query alone:

- keys are taken in chunks of ``KV_CHUNK`` at absolute positions 0, KV_CHUNK, 2 * KV_CHUNK, ...;
- per chunk: scores (q . k over head_dim, a bf16 product), their max and sum of exponentials over
  exactly ``KV_CHUNK`` keys in fp32, and the chunk's weighted values (a product over those keys);
- chunks combine by a sequential scan (``cumsum``) in chunk order. A chunk past the query's
  position (padding, or keys of later queries in the row) has weight exp(-inf) = 0 and adds exact
  zeros at the end of the scan, so it changes nothing.

This holds where the products themselves are batch-invariant: a dot product over head_dim and
over a chunk does not change with the number of rows, queries or chunks beside it. oneDNN's bf16
products on x86 CPUs are (tests/unit/kernels/test_paged_attention_invariant.py checks it bit for
bit); fp32 ones are not (a single row takes a matrix-vector path that sums in another order), so
the worker refuses ``--deterministic`` but in bf16 (services/worker/determinism.py).

Cost against the SDPA backend: keys padded to a whole chunk, and the scores in memory (a long
prefill row's queries go in blocks of ``QUERY_BLOCK``, each over the keys up to its last query;
decodes are batched by length as that backend groups them, ``decode_groups``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from libs.kernels.paged_attention import PagedAttentionMetadata
from libs.kernels.paged_attention_torch import HeadMajorGather, decode_groups, start_forward

KV_CHUNK = 64  # keys per reduction; a multiple of any block size up to it keeps gathers whole pages
QUERY_BLOCK = 128  # queries of a long row attended together (bounds the scores' memory)


@dataclass(frozen=True)
class _Batch:
    """Rows attended together: every decode row of the step, or a block of one row's queries."""

    token_index: Tensor  # [num_rows * query_len] where the queries sit in the step's flat batch
    num_rows: int
    query_len: int
    kv_index: Tensor  # HeadMajorGather.index over the rows' keys, num_chunks * KV_CHUNK each
    allowed: Tensor  # [num_rows, 1, query_len * group, num_chunks * KV_CHUNK] bool: key <= query


class BatchInvariantAttentionBackend:
    """AttentionBackend whose outputs do not depend on the batch (see the module docstring)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.dtype = dtype
        self.scale = head_dim**-0.5
        self._gather = HeadMajorGather(num_kv_heads, head_dim, dtype)
        self._batches: list[_Batch] = []
        self._meta: PagedAttentionMetadata | None = None

    def plan(self, meta: PagedAttentionMetadata) -> None:
        device = meta.block_tables.device
        starts = meta.query_start_loc.tolist()
        context_lens = meta.context_lens.tolist()
        tables = meta.block_tables.long()
        self._batches = []
        for row in range(meta.num_prefills):
            for first in range(starts[row], starts[row + 1], QUERY_BLOCK):
                last = min(first + QUERY_BLOCK, starts[row + 1])
                offset = context_lens[row] + first - starts[row]  # position of the block's first query
                positions = torch.arange(offset, offset + last - first)[None, :]
                tokens = torch.arange(first, last, device=device)
                self._batches.append(self._batch(meta, [row], positions, tokens, tables, device))
        first = meta.num_prefills
        num_chunks = [-(-n // KV_CHUNK) * KV_CHUNK for n in meta.seq_lens[first:].tolist()]
        # Decodes of similar length share a batch (padding a short one to a long one's keys costs
        # work, not bits: its extra chunks add exact zeros).
        for group in decode_groups(num_chunks):
            rows = [first + i for i in group]
            positions = (meta.seq_lens[rows].long() - 1)[:, None]  # [rows, 1]: a decode's position
            # Decode row r's token sits at num_prefill_tokens + (r - num_prefills) in the flat batch.
            tokens = torch.tensor(group, device=device) + meta.num_prefill_tokens
            self._batches.append(self._batch(meta, rows, positions, tokens, tables, device))
        self._gather.reserve([batch.kv_index for batch in self._batches], device)
        self._meta = meta

    def _batch(
        self,
        meta: PagedAttentionMetadata,
        rows: list[int],
        positions: Tensor,
        token_index: Tensor,
        tables: Tensor,
        device: torch.device,
    ) -> _Batch:
        """``positions``: [rows, query_len], the positions of the queries, which sit at
        ``token_index`` in the flat batch, row after row."""
        num_rows, query_len = positions.shape
        num_chunks = -(-(int(positions.max()) + 1) // KV_CHUNK)
        padded_len = num_chunks * KV_CHUNK
        num_blocks = -(-padded_len // meta.block_size)
        row_tables = tables[torch.tensor(rows, device=device)]
        if row_tables.shape[1] < num_blocks:  # keys past the rows' pages read block 0 (masked out)
            row_tables = torch.nn.functional.pad(row_tables, (0, num_blocks - row_tables.shape[1]))
        allowed = torch.arange(padded_len)[None, None, :] <= positions[:, :, None]  # [rows, t, keys]
        # Queries fold as (t, g) -> t * group + g, as the forward lays them out.
        allowed = allowed[:, None, :, None, :].expand(-1, 1, -1, self.group, -1)
        return _Batch(
            token_index=token_index,
            num_rows=num_rows,
            query_len=query_len,
            kv_index=self._gather.index(row_tables, padded_len, meta.block_size),
            allowed=allowed.reshape(num_rows, 1, query_len * self.group, padded_len).to(device),
        )

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        k_vectors, v_vectors = start_forward(self._meta, self.dtype, q, k, v, k_cache, v_cache)
        out = torch.empty_like(q)
        for batch in self._batches:
            n, t = batch.num_rows, batch.query_len
            # [n * t, heads, d] -> [n, kv_heads, t * group, d]; query head h = kv_head * group + g
            queries = q.index_select(0, batch.token_index).view(n, t, self.num_kv_heads, self.group, -1)
            queries = queries.transpose(1, 2).reshape(n, self.num_kv_heads, t * self.group, self.head_dim)
            keys, values = self._gather(k_vectors, v_vectors, batch.kv_index, n)
            attended = self.attend(queries, keys, values, batch.allowed)
            attended = attended.view(n, self.num_kv_heads, t, self.group, self.head_dim).transpose(1, 2)
            out[batch.token_index] = attended.reshape(n * t, self.num_heads, self.head_dim)
        return out

    def attend(self, queries: Tensor, keys: Tensor, values: Tensor, allowed: Tensor) -> Tensor:
        """queries: [n, kv_heads, m, d]; keys, values: [n, kv_heads, chunks * KV_CHUNK, d];
        allowed: [n, 1, m, chunks * KV_CHUNK] (every query allows key 0). Returns [n, kv_heads, m, d]
        in the compute dtype, each query's row a function of its own query, keys and mask only."""
        n, h, m, d = queries.shape
        num_chunks = keys.shape[2] // KV_CHUNK
        scores = torch.matmul(queries, keys.transpose(-1, -2)).float() * self.scale
        scores = scores.masked_fill(~allowed, float("-inf")).view(n, h, m, num_chunks, KV_CHUNK)
        chunk_max = scores.amax(-1, keepdim=True)  # [n, h, m, chunks, 1]; -inf: a chunk all masked
        weights = torch.exp(scores - chunk_max.masked_fill(chunk_max == float("-inf"), 0.0))
        chunk_sum = weights.sum(-1)  # [n, h, m, chunks]
        # [n, h, chunks, m, KV_CHUNK] @ [n, h, chunks, KV_CHUNK, d] -> [n, h, chunks, m, d]
        chunk_out = torch.matmul(
            weights.to(self.dtype).transpose(2, 3), values.view(n, h, num_chunks, KV_CHUNK, d)
        ).float()
        chunk_max = chunk_max.squeeze(-1)
        rescale = torch.exp(chunk_max - chunk_max.amax(-1, keepdim=True))  # [n, h, m, chunks]
        total = (chunk_sum * rescale).cumsum(-1)[..., -1:]  # [n, h, m, 1]
        weighted = (chunk_out * rescale.transpose(2, 3)[..., None]).cumsum(2)[:, :, -1]  # [n, h, m, d]
        return (weighted / total).to(self.dtype)
