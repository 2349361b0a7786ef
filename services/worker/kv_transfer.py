"""KV in and out of the runner's pages around a step: a plan's saves (full blocks to G2 / G3, P/D
handoffs' partial blocks to the handoff area) and its new sequences' loads.

Saves run first, before anything in the step can overwrite a freed page. A load fills the pages
its ``KVLoad`` names in table order and stops at the first it cannot fill; a handoff's partial
block comes last, only when every block before it loaded. The row then computes from the first
page that was not filled, so a missing or unsound block costs compute, never wrong KV.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from libs.protocol.codec import unpack_tokens
from libs.protocol.kv_messages import HASH_NUM_BYTES, KVLoad, split_hashes
from libs.protocol.messages import SchedulerOutput
from services.worker.handoff_area import HandoffArea
from services.worker.kv_cache import KVBlocks
from services.worker.kv_tiers import KVTiers, LoadResult
from services.worker.row_isolation import PlanError, without_blocks

log = logging.getLogger(__name__)


class KVTransfer:
    def __init__(self, kv_cache: KVBlocks, kv_tiers: KVTiers | None, handoff: HandoffArea | None) -> None:
        self.kv_cache = kv_cache
        self.kv_tiers = kv_tiers  # None: no G2 / G3; a plan's loads are all recomputed
        self.handoff = handoff  # None: partial saves are skipped, partial loads recomputed

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    def save(self, plan: SchedulerOutput, unwritten: set[int]) -> None:
        """The plan's saves, less pages a failed sequence never wrote; then its drops."""
        for save in plan.kv_saves:
            block_ids = unpack_tokens(save.block_ids)
            self._check_blocks("kv_saves", block_ids)
            if len(save.block_hashes) != HASH_NUM_BYTES * len(block_ids):
                raise PlanError(f"kv_saves: {len(block_ids)} blocks, {len(save.block_hashes)} hash bytes")
            if unwritten.intersection(block_ids):
                save = without_blocks(save, block_ids, unwritten)
            if self.kv_tiers is not None and save.block_ids:
                self.kv_tiers.save(self.kv_cache, save)
        for partial in plan.partial_saves:
            if not 0 <= partial.block_id < self.kv_cache.num_blocks or len(partial.key) != HASH_NUM_BYTES:
                raise PlanError(f"partial_saves: block {partial.block_id}, a key of {len(partial.key)} bytes")
        handoff = self.handoff
        if handoff is None:
            return
        for partial in plan.partial_saves:
            if partial.block_id in unwritten:
                handoff.skip(partial.key)  # its KV was never written: the decode worker recomputes it
            else:
                handoff.write(partial.key, self.kv_cache.gather_blocks([partial.block_id])[0].cpu())
        try:
            handoff.drop(split_hashes(plan.handoff_drops))
        except ValueError as e:
            raise PlanError(f"handoff_drops: {e}") from None

    def load(
        self, seq_id: str, block_table: Sequence[int], num_computed: int, load: KVLoad
    ) -> tuple[int, LoadResult]:
        """Fill the pages ``load`` names (of a new sequence whose first ``num_computed`` tokens
        count as computed); returns the tokens that really are, and what was loaded."""
        try:
            block_hashes = split_hashes(load.block_hashes)
        except ValueError as e:
            raise PlanError(f"{seq_id}: kv_load: {e}") from None
        first, end, size = load.first_block, load.first_block + len(block_hashes), self.block_size
        partial = bool(load.partial_key)
        # Full pages lie wholly within the computed tokens; a partial one holds their last ones.
        last = end + 1 if partial else end
        if first < 0 or last > len(block_table) or end * size > num_computed:
            raise PlanError(f"{seq_id}: kv_load of blocks {first}..{last} beyond its computed KV")
        if partial and not (
            end * size < num_computed < last * size and len(load.partial_key) == HASH_NUM_BYTES
        ):
            raise PlanError(f"{seq_id}: kv_load's partial block does not end its {num_computed} tokens")
        if self.kv_tiers is not None:
            loaded = self.kv_tiers.load(self.kv_cache, block_table[first:end], block_hashes)
        else:
            loaded = LoadResult(0, 0, len(block_hashes))
        if loaded.num_failed_blocks:
            if partial and self.handoff is not None:
                self.handoff.drop([load.partial_key])  # after a gap, never read: delete it
            restart = (first + loaded.num_loaded_blocks) * size
            return restart, dataclasses.replace(loaded, num_failed_partial_blocks=int(partial))
        if not partial:
            return num_computed, loaded
        page = self.handoff.read(load.partial_key) if self.handoff is not None else None
        if page is None:
            return end * size, dataclasses.replace(loaded, num_failed_partial_blocks=1)
        self.kv_cache.scatter_blocks([block_table[end]], page.unsqueeze(0))
        return num_computed, dataclasses.replace(loaded, num_partial_blocks=1)

    def _check_blocks(self, what: str, block_ids: list[int]) -> None:
        if max(block_ids, default=0) >= self.kv_cache.num_blocks:
            raise PlanError(f"{what}: block id beyond the pool")
