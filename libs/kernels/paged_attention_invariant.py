"""Batch-invariant paged attention (``--deterministic``): a query's output depends on its own query
and keys only, never on the other rows of the step, how its prompt was chunked, or how far its
row's keys were padded. Layout and reference: paged_attention.py.

The CPU backend (paged_attention_torch.py) runs long prefill rows through SDPA (and, without the
extension, decodes too, padded to their group's longest row), whose reductions over the keys
change with the padded length: a query's output then depends on its batch mates. Here, where the
CPU extension is built, every token goes to its paged kernel, invariant by construction (see
``BatchInvariantAttentionBackend``). Elsewhere every reduction has a shape fixed by the query alone:

- keys are taken in chunks of ``KV_CHUNK`` at absolute positions 0, KV_CHUNK, 2 * KV_CHUNK, ...;
- per chunk and query position: scores (a [KV_CHUNK, d] @ [d, group] product in fp32), their max
  over the chunk, and the chunk's weighted values with the sum of its weights (a
  [d + 1, KV_CHUNK] @ [KV_CHUNK, group] product: a column of ones beside the values sums them);
- chunks combine by a sequential scan (``cumsum``) in chunk order. A chunk past the query's
  position (padding, or keys of later queries in the row) has weight exp(MASKED - max) = 0 and
  adds exact zeros at the end of the scan, so it changes nothing.

Every product has the same shape in every step, batched over rows, heads, positions and chunks.
That is what makes it invariant: the matmul library computes a batch of equal products one by
one, the same way whatever their number, while one product's bits change with its own shape (an
fp32 product of one row takes a matrix-vector path, of 5 or more another blocking; measured with
MKL here). tests/unit/kernels/test_paged_attention_invariant.py checks it bit for bit, and the
worker's start-up probe on the machine it runs on (services/worker/determinism.py).

Cost of this fallback against the SDPA backend: keys padded to a whole chunk, and a long prefill
row's keys copied once per position of a block of ``QUERY_BLOCK`` (the product broadcasts them);
decodes are batched by length as that backend groups them (``decode_groups``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from libs.kernels.paged_attention import PagedAttentionMetadata
from libs.kernels.paged_attention_torch import (
    HeadMajorGather,
    KernelTokens,
    begin_forward,
    decode_groups,
    kernel_ops,
    start_forward,
)

KV_CHUNK = 64  # keys per reduction; a multiple of any block size up to it keeps gathers whole pages
QUERY_BLOCK = 32  # positions of a long row attended together (bounds the copies of its keys)
EXP_SLICE = 16384  # see exp_invariant_
MASKED = -1e30  # a masked score: finite, so a chunk with no key allowed stays finite (weight 0 later)


def exp_invariant_(x: Tensor) -> Tensor:
    """exp of contiguous ``x`` in place, every element by the same code whatever ``x``'s size.

    torch's CPU exp runs a vectorized exp over whole vectors and a scalar one (other bits, now and
    then) over a loop's last few elements; the elements that fall there depend on the tensor's
    size and on how threads split it. So it runs here over slices of ``EXP_SLICE`` elements (too
    few to be split across threads), a multiple of any vector width, and a last partial slice is
    padded to one in a copy."""
    flat = x.view(-1)
    num_whole = flat.numel() - flat.numel() % EXP_SLICE
    for start in range(0, num_whole, EXP_SLICE):
        flat[start : start + EXP_SLICE].exp_()
    if num_whole < flat.numel():
        rest = flat.new_zeros(EXP_SLICE)
        rest[: flat.numel() - num_whole] = flat[num_whole:]
        flat[num_whole:] = rest.exp_()[: flat.numel() - num_whole]
    return x


@dataclass(frozen=True)
class _Batch:
    """Rows attended together: every decode row of the step, or a block of one row's queries."""

    token_index: Tensor  # [num_rows * query_len] where the queries sit in the step's flat batch
    num_rows: int
    query_len: int
    kv_index: Tensor  # HeadMajorGather.index over the rows' keys, num_chunks * KV_CHUNK each
    mask: Tensor  # [num_rows, 1, query_len, num_chunks, KV_CHUNK, 1] fp32: 0 (key <= query) or MASKED


class BatchInvariantAttentionBackend:
    """AttentionBackend whose outputs do not depend on the batch (see the module docstring).

    With ``use_kernel`` (CPU tensors, the extension built, its dtypes) every token of a step goes
    to the extension's paged kernel instead, which is batch-invariant by construction: one thread
    computes a (query, KV head) item whole, from its query and its row's first n keys read in
    place, in an order set by n alone (libs/kernels/csrc/cpu_ops.cpp). It costs no padding, no
    copies and no small products: at 8 decodes about SDPA's time instead of 5x it."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, use_kernel: bool = False
    ) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.dtype = dtype
        self.scale = head_dim**-0.5
        self._gather = HeadMajorGather(num_kv_heads, head_dim, dtype)
        self._ones_buf = torch.ones(0)  # see _augmented_values
        self._batches: list[_Batch] = []
        self._meta: PagedAttentionMetadata | None = None
        self._ops = kernel_ops(num_heads, num_kv_heads, dtype) if use_kernel else None
        self.use_kernel = self._ops is not None
        self._kernel: KernelTokens | None = None

    def plan(self, meta: PagedAttentionMetadata) -> None:
        self._meta = meta
        self._kernel = KernelTokens.plan(meta, self._ops, every_token=True) if self._ops is not None else None
        if self._kernel is not None:
            self._batches = []
            return
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
        mask = torch.zeros(allowed.shape).masked_fill_(~allowed, MASKED)
        return _Batch(
            token_index=token_index,
            num_rows=num_rows,
            query_len=query_len,
            kv_index=self._gather.index(row_tables, padded_len, meta.block_size),
            mask=mask.view(num_rows, 1, query_len, num_chunks, KV_CHUNK, 1).to(device),
        )

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        if self._kernel is not None:
            begin_forward(self._meta, self.dtype, q, k, v, k_cache, v_cache)
            out = torch.empty(q.shape, dtype=q.dtype)  # contiguous, as the kernel writes it
            self._kernel.run(out, q, k_cache, v_cache, self.scale)
            return out
        k_vectors, v_vectors = start_forward(self._meta, self.dtype, q, k, v, k_cache, v_cache)
        out = torch.empty_like(q)
        for batch in self._batches:
            n, t = batch.num_rows, batch.query_len
            # [n * t, heads, d] -> [n, t, kv_heads, group, d]: query head h = kv_head * group + g
            queries = q.index_select(0, batch.token_index).view(n, t, self.num_kv_heads, self.group, -1)
            keys, values = self._gather(k_vectors, v_vectors, batch.kv_index, n)
            attended = self.attend(queries, keys, values, batch.mask)
            out[batch.token_index] = attended.reshape(n * t, self.num_heads, self.head_dim)
        return out

    def _augmented_values(self, values: Tensor) -> Tensor:
        """``values`` ([n, h, chunks * KV_CHUNK, d]) per chunk, transposed, in fp32 under a row of
        ones: [n, h, chunks, d + 1, KV_CHUNK], in a buffer kept across layers and steps. Its blocks
        are (d + 1) * KV_CHUNK long whatever the view, so the ones, written once when it grows,
        stay in place."""
        n, h, num_keys, d = values.shape
        num_chunks = num_keys // KV_CHUNK
        size = n * h * num_keys * (d + 1)
        if self._ones_buf.numel() < size or self._ones_buf.device != values.device:
            self._ones_buf = torch.ones(size, dtype=torch.float32, device=values.device)
        augmented = self._ones_buf[:size].view(n, h, num_chunks, d + 1, KV_CHUNK)
        augmented[:, :, :, :d] = values.view(n, h, num_chunks, KV_CHUNK, d).transpose(-1, -2)
        return augmented

    def attend(self, queries: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """queries: [n, t, kv_heads, group, d]; keys, values: [n, kv_heads, chunks * KV_CHUNK, d];
        mask: [n, 1, t, chunks, KV_CHUNK, 1] (every query allows key 0). Returns
        [n, t, kv_heads, group, d] in the compute dtype.

        Every product has one shape whatever the step: a chunk's keys by one position's queries
        of one KV head ([KV_CHUNK, d] @ [d, group]), and its values, with a column of ones that
        sums the weights, by those queries' weights ([d + 1, KV_CHUNK] @ [KV_CHUNK, group]), in
        fp32, batched over rows, heads, positions and chunks (a batch of equal products is
        computed product by product)."""
        n, t, h, g, d = queries.shape
        num_chunks = keys.shape[2] // KV_CHUNK
        batch = (n, h, t, num_chunks)
        # Both operands of each product are laid out alike, contiguous, whatever the step: a
        # strided view takes another kernel (a transposed operand) with other bits.
        # [n, h, t, chunks, KV_CHUNK, d] @ [n, h, t, chunks, d, g] -> [n, h, t, chunks, KV_CHUNK, g]
        chunked_keys = keys.float().view(n, h, 1, num_chunks, KV_CHUNK, d).expand(*batch, KV_CHUNK, d)
        queries_t = queries.float().permute(0, 2, 1, 4, 3).unsqueeze(3).expand(*batch, d, g)
        scores = torch.matmul(chunked_keys.contiguous(), queries_t.contiguous())
        scores = torch.add(mask, scores, alpha=self.scale)
        chunk_max = scores.amax(4, keepdim=True)  # [n, h, t, chunks, 1, g]
        weights = exp_invariant_(scores.sub_(chunk_max))  # a masked key: exp(MASKED - max) = 0
        augmented = self._augmented_values(values)
        # [n, h, t, chunks, d + 1, KV_CHUNK] @ [n, h, t, chunks, KV_CHUNK, g] -> [..., d + 1, g]
        chunked_values = augmented.unsqueeze(2).expand(*batch, d + 1, KV_CHUNK)
        chunk_out = torch.matmul(chunked_values.contiguous(), weights)
        # A chunk past the query (all masked) has max MASKED: its rescale is exp(-1e30) = 0.
        rescale = exp_invariant_(chunk_max.sub_(chunk_max.amax(3, keepdim=True)))  # [n, h, t, chunks, 1, g]
        combined = chunk_out.mul_(rescale).cumsum(3)[:, :, :, -1]  # [n, h, t, d + 1, g]
        out = combined[:, :, :, :d] / combined[:, :, :, d:]  # [n, h, t, d, g]
        return out.permute(0, 2, 1, 4, 3).to(self.dtype)
