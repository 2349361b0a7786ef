"""Where the scheduler core's sequences get KV from and where their KV goes. Pure: no nats,
asyncio or torch.

An admitted sequence starts on KV that exists: choice 0's prompt blocks, else the longest hit of
the prefix cache (G1), extended by the blocks G2 / G3 hold after it (a load in the plan). Full
blocks the plans made so far compute enter the cache; store points queue saves to the lower tiers.
"""

from __future__ import annotations

from services.scheduler.block_manager import BlockManager
from services.scheduler.kv_tiers import TierPlanner
from services.scheduler.limits import Limits
from services.scheduler.plan import Plan
from services.scheduler.prefix_cache import BlockHasher
from services.scheduler.sequence import Sequence, SequenceStatus


class KVReuse:
    def __init__(
        self, limits: Limits, block_manager: BlockManager, hasher: BlockHasher, kv_tiers: TierPlanner
    ) -> None:
        self.limits = limits
        self.block_manager = block_manager
        self._hasher = hasher
        self.kv_tiers = kv_tiers

    def reuse_prefix(self, seq: Sequence, parent: Sequence | None, plan: Plan) -> int | None:
        """Start ``seq`` on KV that exists: choice 0's (``parent``'s) prompt blocks, else the
        longest hit of the prefix cache, extended by the blocks G2 / G3 hold after it (a load in
        ``plan``), and by a P/D handoff's partial block after those. Returns the tokens of the
        blocks the tiers held (full blocks only), or None when they were not asked."""
        self._share_prompt(seq, parent)
        if seq.num_computed_tokens or not self.limits.enable_prefix_caching:
            return None
        # Never the block holding the last token: computing it gives the logits to sample from.
        max_blocks = max(0, seq.num_tokens - 1) // self.limits.block_size
        block_hashes = self._hasher.extend(seq, max_blocks)
        num_blocks = self.block_manager.match(seq.seq_id, block_hashes, max_blocks)
        load = self.kv_tiers.extend_hit(seq, num_blocks, max_blocks)
        if load is not None:
            num_blocks += len(load.tiers)
        load = self.kv_tiers.extend_with_partial(seq, num_blocks, load)
        num_hit_tokens = num_blocks * self.limits.block_size
        seq.num_computed_tokens = num_hit_tokens
        if load is not None:
            plan.kv_loads[seq.seq_id] = load
            if load.partial_key:  # a handoff's partial block: the whole prompt is computed
                seq.num_computed_tokens = seq.num_prompt_tokens
        return num_hit_tokens

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Offer the cache ``seq``'s full blocks whose tokens are known and whose KV the plans
        made so far compute (tokens only the worker knows yet stay out)."""
        if not self.limits.enable_prefix_caching:
            return
        num_blocks = min(seq.num_computed_tokens, seq.num_tokens) // self.limits.block_size
        if num_blocks > self.block_manager.num_cached_blocks_of(seq.seq_id):  # a block filled up
            block_hashes = self._hasher.extend(seq, num_blocks)
            self.block_manager.cache_blocks(seq.seq_id, block_hashes, num_blocks)

    def save(self, seq: Sequence, num_tokens: int) -> None:
        """Queue a save of the full blocks among ``seq``'s first ``num_tokens`` (computed by the
        plans made so far) for the next plan."""
        table = self.block_manager.block_tables[seq.seq_id]
        self.kv_tiers.queue_save(seq, table, num_tokens // self.limits.block_size)

    def release(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks; its computed full blocks stay cached for later plans."""
        self.cache_computed_blocks(seq)
        self.block_manager.free(seq.seq_id)

    def _share_prompt(self, seq: Sequence, parent: Sequence | None) -> None:
        if seq.index == 0 or seq.output_token_ids:
            return
        if parent is None or parent.status is not SequenceStatus.RUNNING:
            return
        # Full blocks only, and never the prompt's last token: the choice samples from its logits.
        num_blocks = (seq.num_prompt_tokens - 1) // self.limits.block_size
        if num_blocks > 0:
            self.block_manager.share(parent.seq_id, seq.seq_id, num_blocks)
            seq.num_computed_tokens = num_blocks * self.limits.block_size
            seq.num_saved_blocks = min(parent.num_saved_blocks, num_blocks)  # saved in its prompt
