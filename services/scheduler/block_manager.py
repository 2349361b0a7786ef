"""Logical KV blocks of one worker: free list, reference counts, each sequence's block table, and
the G1 prefix cache of full blocks nobody holds any more.

Pure: no torch. The scheduler decides which physical page of the worker's KV pool holds which
tokens; the worker only follows the block tables it is sent. A sequence's token at position p
lives in slot ``block_table[p // block_size] * block_size + p % block_size``.

Blocks are reference-counted so that sequences can share the full blocks of a common prefix (the
n choices of one request share their prompt's; prefix-cache hits share a cached prefix). Shared
blocks are only ever full and never written again: a sequence writes only at positions past what
it shares. When the last owner lets go, a cached block (``cache_blocks`` gave it its hash) stays
in the prefix cache, evictable, and an uncached one returns to the free list. Allocation takes
free blocks first, then evicts the least recently used cached block.

Every block is in exactly one of three states: owned (ref count > 0, in that many tables; cached
or not), evictable (ref count 0, cached, in the LRU) or free (ref count 0, not cached).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from services.scheduler.prefix_cache import PrefixCache


class OutOfBlocks(Exception):
    def __init__(self, requested: int, num_free: int) -> None:
        super().__init__(f"KV cache full: need {requested} blocks, {num_free} free")
        self.requested = requested
        self.num_free = num_free


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self.block_tables: dict[str, list[int]] = {}
        self.prefix_cache = PrefixCache()
        self._num_cached: dict[str, int] = {}  # seq id -> leading blocks of its table offered to the cache

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocation can take: free ones, then evictable cached ones."""
        return len(self._free) + self.prefix_cache.num_evictable_blocks

    def num_cached_blocks_of(self, seq_id: str) -> int:
        """Leading blocks of ``seq_id``'s table already offered to the prefix cache."""
        return self._num_cached.get(seq_id, 0)

    def num_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Blocks to add so that ``seq_id``'s table holds ``num_tokens`` tokens."""
        have = len(self.block_tables.get(seq_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, seq_id: str, num_tokens: int, reserve: int = 0) -> bool:
        """Whether growing to ``num_tokens`` leaves at least ``reserve`` blocks free (or evictable)."""
        return self.num_blocks_needed(seq_id, num_tokens) + reserve <= self.num_free_blocks

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow ``seq_id``'s table to hold ``num_tokens`` tokens; returns the blocks added."""
        needed = self.num_blocks_needed(seq_id, num_tokens)
        if needed > self.num_free_blocks:
            raise OutOfBlocks(needed, self.num_free_blocks)
        added = [self._free.popleft() if self._free else self.prefix_cache.evict() for _ in range(needed)]
        for block_id in added:
            self._ref_counts[block_id] = 1
        self.block_tables.setdefault(seq_id, []).extend(added)
        return added

    def share(self, src_seq_id: str, dst_seq_id: str, num_blocks: int) -> list[int]:
        """Start ``dst_seq_id``'s (empty) table with the first ``num_blocks`` full blocks of the source."""
        assert not self.block_tables.get(dst_seq_id), "sharing starts a table"
        shared = self.block_tables[src_seq_id][:num_blocks]
        assert len(shared) == num_blocks, "the source does not hold that many blocks"
        for block_id in shared:
            self._ref_counts[block_id] += 1
        self.block_tables[dst_seq_id] = list(shared)
        return shared

    def match(self, seq_id: str, block_hashes: Sequence[bytes], max_blocks: int) -> int:
        """Start ``seq_id``'s (empty) table with the cached blocks of the longest cached prefix of
        ``block_hashes[:max_blocks]``; returns how many blocks it took."""
        assert not self.block_tables.get(seq_id), "a hit starts a table"
        hits = self.prefix_cache.lookup(block_hashes, max_blocks)
        for block_id in hits:
            if self._ref_counts[block_id] == 0:
                self.prefix_cache.unpark(block_id)
            self._ref_counts[block_id] += 1
        if hits:
            self.block_tables[seq_id] = hits
            self._num_cached[seq_id] = len(hits)
        return len(hits)

    def cache_blocks(self, seq_id: str, block_hashes: Sequence[bytes], num_blocks: int) -> None:
        """Offer the cache the first ``num_blocks`` blocks of ``seq_id``'s table under their hashes.

        The caller vouches that plans already made write the KV of every token of those blocks:
        a later plan may then find them (see WorkerScheduler on why that ordering is safe).
        """
        start = self._num_cached.get(seq_id, 0)
        if num_blocks <= start:
            return
        table = self.block_tables[seq_id]
        assert num_blocks <= min(len(table), len(block_hashes)), "caching blocks it does not hold"
        for i in range(start, num_blocks):
            self.prefix_cache.insert(table[i], block_hashes[i])
        self._num_cached[seq_id] = num_blocks

    def free(self, seq_id: str, forget: bool = False) -> None:
        """Drop ``seq_id``'s table; blocks nobody else holds become evictable if cached, else free.

        The table's last block parks first: a chain's tail is the least likely part to be hit
        again, and evicting it first keeps the rest of the chain reachable. ``forget``: the
        sequence failed, and plans made before the failure was known may have cached blocks whose
        KV was never written: every block of its table leaves the cache, even one another
        sequence holds now (a miss costs a recompute, a wrong block would reach attention).
        """
        self._num_cached.pop(seq_id, None)
        for block_id in reversed(self.block_tables.pop(seq_id, ())):
            self._ref_counts[block_id] -= 1
            if forget:  # also if another holds it: a hit in the same plan (the worker recomputes it)
                self.prefix_cache.forget(block_id)
            if self._ref_counts[block_id] > 0:
                continue
            if not self.prefix_cache.park(block_id):
                self._free.append(block_id)

    def check_integrity(self) -> None:
        counts = [0] * self.num_blocks
        for seq_id, table in self.block_tables.items():
            assert len(table) == len(set(table)), "a table holds a block twice"
            num_cached = self._num_cached.get(seq_id)
            assert num_cached is None or 0 < num_cached <= len(table), "cached more blocks than held"
            for block_id in table:
                counts[block_id] += 1
        assert counts == self._ref_counts, "reference counts disagree with the block tables"
        assert set(self._num_cached) <= set(self.block_tables), "a freed table still counts cached blocks"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is free twice"
        evictable = self.prefix_cache.evictable_block_ids()
        assert not free & evictable, "a block is both free and evictable"
        assert all(self.prefix_cache.hash_of(b) is None for b in free), "a free block is still cached"
        for block_id, count in enumerate(counts):
            unowned = block_id in free or block_id in evictable
            assert (count == 0) == unowned, "a block leaked, or is owned and free or evictable"
        self.prefix_cache.check_integrity()
