"""Keeps one bad sequence of a step from failing the others: a forward that raises is rerun row
by row, rows whose logits are not finite are dropped, and what a failed row left (its grammar
results, saves of KV it never wrote) is left out of the rest of the step."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from libs.protocol.codec import pack_tokens
from libs.protocol.kv_messages import KVSave, join_hashes, split_hashes
from services.worker.mask_job import MaskResult
from services.worker.sampler import GrammarMask

log = logging.getLogger(__name__)


class PlanError(ValueError):
    """A plan that contradicts what the worker holds (a scheduler bug, or a lost step)."""


class _HasSeqId(Protocol):
    @property
    def seq_id(self) -> str: ...


R = TypeVar("R", bound=_HasSeqId)


def forward_isolating(
    forward: Callable[[list[R]], torch.Tensor | None],
    rows: list[R],
    failed: dict[str, str],
    blame_lone_row: bool = True,
) -> tuple[list[R], torch.Tensor | None]:
    """``forward`` over ``rows``; if it raises, each row is rerun alone (it rewrites the same
    KV slots) and those that still raise go to ``failed``. Returns the rows that ran and the
    logits of those among them that sample. If every row of several raises alone, nothing is
    row-specific: the first error is raised (the step fails). A lone row cannot tell: it fails,
    unless ``blame_lone_row`` is off (lone rows kept failing: the model is broken), and then the
    step does. A ``PlanError`` is never a row's: it is raised at once."""
    try:
        return rows, forward(rows)
    except PlanError:
        raise
    except Exception as exc:
        if len(rows) == 1:
            if not blame_lone_row:
                raise
            failed[rows[0].seq_id] = f"the model failed on this sequence: {exc!r}"
            return [], None
        log.warning("forward of %d rows failed (%r): rerunning them one by one", len(rows), exc)
        first = exc
    ran: list[R] = []
    parts: list[torch.Tensor] = []
    for row in rows:
        try:
            logits = forward([row])
        except Exception as exc:
            failed[row.seq_id] = f"the model failed on this sequence: {exc!r}"
            continue
        ran.append(row)
        if logits is not None:
            parts.append(logits)
    if not ran:
        raise first
    return ran, torch.cat(parts) if parts else None


def drop_non_finite(
    logits: torch.Tensor, keep: list[int], seq_id_of: Callable[[int], str], failed: dict[str, str]
) -> tuple[torch.Tensor, list[int]]:
    """``logits`` ([len(keep), vocab]) and ``keep`` less the rows whose logits are not all
    finite; those rows' sequences (``seq_id_of(keep[k])``) go to ``failed``."""
    # [num_kept]: a NaN or an Inf anywhere in a row makes its sum NaN or Inf. One reduction, ~10x
    # cheaper than isfinite over the vocabulary; a finite row's sum could overflow only with logits
    # past 1e33, which fails that row too.
    finite = torch.isfinite(logits.sum(dim=-1))
    if bool(finite.all()):
        return logits, keep
    for k in (~finite).nonzero().flatten().tolist():
        failed[seq_id_of(keep[k])] = "the model's logits are not finite (NaN or Inf)"
    good = finite.nonzero().flatten()
    return logits.index_select(0, good), [keep[k] for k in good.tolist()]


def without_blocks(save: KVSave, block_ids: list[int], unwritten: set[int]) -> KVSave:
    """``save`` less the blocks in ``unwritten`` (and their hashes)."""
    hashes = split_hashes(save.block_hashes)
    kept = [(b, h) for b, h in zip(block_ids, hashes, strict=True) if b not in unwritten]
    return dataclasses.replace(
        save, block_ids=pack_tokens([b for b, _ in kept]), block_hashes=join_hashes([h for _, h in kept])
    )


def kept_mask(mask: MaskResult | None, keep: list[int]) -> tuple[GrammarMask | None, dict[int, str]]:
    """The grammar results of the sampling rows ``keep`` names, renumbered to their place in it:
    the bias of each kept masked row, and why a kept row's grammar failed."""
    if mask is None:
        return None, {}
    place = {j: k for k, j in enumerate(keep)}
    failed = {place[j]: why for j, why in mask.failed.items() if j in place}
    biased = [i for i, j in enumerate(mask.rows) if j in place]
    if mask.bias is None or not biased:
        return None, failed
    bias = mask.bias if len(biased) == len(mask.rows) else mask.bias[biased]
    return GrammarMask([place[mask.rows[i]] for i in biased], bias), failed
