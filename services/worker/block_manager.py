"""Fixed-size KV blocks for the worker's sequences: free list, block tables. Pure: no torch.

A sequence's token at position p lives in slot ``block_table[p // block_size] * block_size +
p % block_size`` of the KV pool. The engine-core work moves logical block tables to the scheduler;
until then the worker keeps them.
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
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        have = len(self.block_tables.get(seq_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        return self.num_blocks_needed(seq_id, num_tokens) <= len(self._free)

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow ``seq_id``'s table to hold ``num_tokens`` tokens; returns the whole table."""
        needed = self.num_blocks_needed(seq_id, num_tokens)
        if needed > len(self._free):
            raise OutOfBlocks(needed, len(self._free))
        table = self.block_tables.setdefault(seq_id, [])
        table.extend(self._free.popleft() for _ in range(needed))
        return table

    def free(self, seq_id: str) -> None:
        self._free.extend(self.block_tables.pop(seq_id, ()))

    def slot(self, seq_id: str, position: int) -> int:
        block_id = self.block_tables[seq_id][position // self.block_size]
        return block_id * self.block_size + position % self.block_size

    def check_integrity(self) -> None:
        used = [b for table in self.block_tables.values() for b in table]
        assert len(used) == len(set(used)), "a block is owned twice"
        assert not set(used) & set(self._free), "a block is both free and used"
        assert len(used) + len(self._free) == self.num_blocks, "blocks leaked"
