"""The numbers one worker's scheduler core works within: its KV pool, batch limits and which KV
tiers it uses. Pure: a frozen dataclass the core and its collaborators take instead of a config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    num_blocks: int  # the worker's KV pages
    block_size: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int  # tokens computed per step, prefill chunks included
    max_num_waiting: int  # queued sequences before QueueFull
    watermark: float = 0.01  # share of blocks admission leaves free, so decodes rarely preempt
    enable_prefix_caching: bool = True  # reuse cached full blocks of a common prefix (G1)
    enable_kv_tiers: bool = True  # also load from G2 / G3 and save at store points (needs G1)
    speculative_method: str = "none"  # automatic drafts: none | ngram | suffix (see speculation)
    num_speculative_tokens: int = 0  # the most tokens drafted for a sequence per step (0: none)
    speculative_policy: str = "adaptive"  # how much of each draft is verified (see spec_policy)

    @property
    def context_len(self) -> int:
        """The longest sequence: the model's window, or the whole KV pool if that is smaller."""
        return min(self.max_model_len, self.num_blocks * self.block_size)
