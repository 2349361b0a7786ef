"""MaskJob: a step's grammar masks, filled on a helper thread while the forward runs.

The job starts before the forward and is joined after it, so the mask work overlaps the model
instead of adding to the step. It fills one bitmask row per sampled position of each constrained
row (a drafted row has one per verified position: ``SequenceGrammar.fill_drafted``) and turns
them into additive biases.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from libs.kernels.token_mask import bitmask_to_bias
from services.worker.grammar import SequenceGrammar


@dataclass(frozen=True, slots=True)
class MaskResult:
    rows: list[int]  # sampled positions of the step (indices into its logits rows)
    bias: torch.Tensor | None  # [len(rows), vocab] float32 0 / -inf; None when no row is masked
    failed: dict[int, str]  # a row's first sampled position -> why its grammar cannot be used


@dataclass(frozen=True, slots=True)
class MaskRequest:
    position: int  # the row's first sampled position in the step
    grammar: SequenceGrammar
    remaining: int  # output tokens it may still produce, the one sampled there included
    draft: Sequence[int] = ()  # drafts verified after it: one more position each


class MaskJob:
    """Fills a step's masks on one helper thread (a thread, not a process: the forward releases the
    GIL in its kernels, and the matchers' state must stay in this process)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    def start(self, requests: list[MaskRequest]) -> Future[MaskResult]:
        return self._executor.submit(self._build, requests)

    def _build(self, requests: list[MaskRequest]) -> MaskResult:
        num_rows = sum(1 + len(r.draft) for r in requests)
        bitmask = torch.empty(num_rows, (self.vocab_size + 31) // 32, dtype=torch.int32)
        rows: list[int] = []
        failed: dict[int, str] = {}
        for request in requests:
            try:
                request.grammar.fill_drafted(bitmask, len(rows), request.remaining, request.draft)
            except Exception as exc:  # a compile error surfaces here, for this sequence only
                failed[request.position] = f"structured output: {exc}"
                continue
            rows += range(request.position, request.position + 1 + len(request.draft))
        if not rows:
            return MaskResult([], None, failed)
        return MaskResult(rows, bitmask_to_bias(bitmask[: len(rows)], self.vocab_size), failed)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
