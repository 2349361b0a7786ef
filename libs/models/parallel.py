"""The ranks of one sharded model (``TPGroup``), how a dimension splits over them, and the modules
that end a rank's share of the work with a collective.

Every rank sees the whole step's tokens (activations are replicated) and computes its share:
a column-parallel projection keeps its output split (no collective), a row-parallel part ends in
an all-reduce of the partial sums (``RowParallel``), the embedding and the LM head split the
vocabulary (``VocabParallelEmbedding``, ``VocabParallelHead``). How each model's weights split
is in ``libs.models.sharding``.

An all-reduce adds the ranks' partial sums in another order than one rank's matmul does: sharded
logits equal unsharded ones to fp32 rounding, not to the bit.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from libs.kernels.linear import linear
from libs.models.shm_all_reduce import ShmAllReduce


class TPGroup:
    """This process's rank among ``size`` ranks and their process group. ``size`` 1 (``SINGLE``):
    every collective is the identity and no torch.distributed group exists."""

    def __init__(self, rank: int, size: int, group: dist.ProcessGroup | None = None) -> None:
        if not 0 <= rank < size or (size > 1 and group is None):
            raise ValueError(f"rank {rank} of {size} ranks (group {group})")
        self.rank = rank
        self.size = size
        self.group = group
        # Bytes this rank handed to each kind of collective, for bench/parallel.py.
        self.num_bytes = {"all_reduce": 0, "gather": 0}
        # Ranks on one CPU node: all-reduces that fit go through shared memory (shm_all_reduce.py).
        self.shm: ShmAllReduce | None = None

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum over ranks of ``x`` (in place), on every rank."""
        if self.size == 1:
            return x
        if self.shm is not None and self.shm.fits(x):
            self.shm(x)
        else:
            dist.all_reduce(x, group=self.group)
        self.num_bytes["all_reduce"] += x.numel() * x.element_size()
        return x

    def gather_columns(self, x: Tensor, widths: Sequence[int]) -> Tensor:
        """x: [n, widths[rank]] -> on rank 0, [n, sum(widths)]: each rank's columns in rank order;
        other ranks get their own x back. Uneven widths travel padded to the widest."""
        if self.size == 1:
            return x
        width = max(widths)
        padded = x if x.shape[1] == width else F.pad(x, (0, width - x.shape[1]))
        padded = padded.contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(padded, parts, dst=0, group=self.group)
        self.num_bytes["gather"] += padded.numel() * padded.element_size()
        if parts is None:
            return x
        return torch.cat([part[:, :w] for part, w in zip(parts, widths, strict=True)], dim=1)


SINGLE = TPGroup(0, 1)


def split_evenly(total: int, parts: int) -> list[range]:
    """``range(total)`` in ``parts`` contiguous pieces, the first ``total % parts`` one longer:
    3 KV heads over 2 ranks are [0, 2) and [2, 3)."""
    if not 0 < parts <= total:
        raise ValueError(f"cannot split {total} over {parts} ranks")
    base, extra = divmod(total, parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + base + (part < extra))
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def scaled(r: range, factor: int, offset: int = 0) -> range:
    """The rows ``r`` names when each unit is ``factor`` rows wide and they start at ``offset``."""
    return range(offset + r.start * factor, offset + r.stop * factor)


class RowParallel(nn.Module):
    """A block part whose output on each rank is a partial sum (its last projection takes this
    rank's input columns), completed by an all-reduce: the same output as the unsharded part."""

    def __init__(self, inner: nn.Module, tp: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.tp = tp

    def forward(self, *args: object) -> Tensor:
        out: Tensor = self.inner(*args)
        return self.tp.all_reduce(out)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding table, ids [first, first + rows): an id elsewhere looks
    up zeros here, and the all-reduce adds the one rank's row that holds it."""

    def __init__(self, weight: Tensor, first: int, tp: TPGroup) -> None:
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True)
        self.first = first
        self.tp = tp

    def forward(self, input: Tensor) -> Tensor:
        local = input - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(out)


class TiedHead(nn.Module):
    """The LM head that reads the embedding table (a tied head); moves with it."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, hidden: Tensor) -> Tensor:
        return linear(hidden, self.embedding.weight)


class VocabParallelHead(nn.Module):
    """The logits of this rank's vocabulary rows, gathered to rank 0 as the whole vocabulary
    (fp32): [n, hidden] -> [n, vocab_size] on rank 0."""

    def __init__(self, inner: nn.Module, widths: Sequence[int], tp: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.widths = tuple(widths)
        self.tp = tp

    def forward(self, hidden: Tensor) -> Tensor:
        local: Tensor = self.inner(hidden)
        return self.tp.gather_columns(local.float(), self.widths)
