"""Logical KV blocks of one worker: free list, reference counts and each sequence's block table.

Pure: no torch. The scheduler decides which physical page of the worker's KV pool holds which
tokens; the worker only follows the block tables it is sent. A sequence's token at position p
lives in slot ``block_table[p // block_size] * block_size + p % block_size``.

Blocks are reference-counted so that sequences can share the full blocks of a common prefix (the
n choices of one request share their prompt's; prefix caching builds on the same counts). A block
returns to the free list when its last owner lets go. Shared blocks are only ever full and never
written again: a sequence writes only at positions past what it shares.
"""

from __future__ import annotations

from collections import deque


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

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Blocks to add so that ``seq_id``'s table holds ``num_tokens`` tokens."""
        have = len(self.block_tables.get(seq_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, seq_id: str, num_tokens: int, reserve: int = 0) -> bool:
        """Whether growing to ``num_tokens`` leaves at least ``reserve`` blocks free."""
        return self.num_blocks_needed(seq_id, num_tokens) + reserve <= len(self._free)

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow ``seq_id``'s table to hold ``num_tokens`` tokens; returns the blocks added."""
        needed = self.num_blocks_needed(seq_id, num_tokens)
        if needed > len(self._free):
            raise OutOfBlocks(needed, len(self._free))
        added = [self._free.popleft() for _ in range(needed)]
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

    def free(self, seq_id: str) -> None:
        """Drop ``seq_id``'s table; blocks nobody else holds go back to the free list."""
        for block_id in self.block_tables.pop(seq_id, ()):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def check_integrity(self) -> None:
        counts = [0] * self.num_blocks
        for table in self.block_tables.values():
            assert len(table) == len(set(table)), "a table holds a block twice"
            for block_id in table:
                counts[block_id] += 1
        assert counts == self._ref_counts, "reference counts disagree with the block tables"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is free twice"
        assert all((c == 0) == (b in free) for b, c in enumerate(counts)), "blocks leaked or double-owned"
