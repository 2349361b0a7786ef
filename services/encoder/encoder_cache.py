"""The encoder cache's bookkeeping: which images' outputs are stored, in least-recently-used
order, within a byte budget. Pure: the service removes the files of what it evicts.

An output is used when a request names its image (a hit touches it) and when it is written. The
budget is in bytes of the stored outputs, as vLLM's encoder cache counts embedding tokens: an
image costs its rows times the hidden size times the element size.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCache:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"encoder cache capacity {capacity_bytes} bytes: must be > 0")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # hash -> (tokens, bytes)
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, mm_hash: bytes) -> bool:
        return mm_hash in self._entries

    def lookup(self, mm_hash: bytes) -> int | None:
        """Its number of tokens (and it is now the most recently used), or None: not cached."""
        entry = self._entries.get(mm_hash)
        if entry is None:
            self.num_misses += 1
            return None
        self._entries.move_to_end(mm_hash)
        self.num_hits += 1
        return entry[0]

    def insert(self, mm_hash: bytes, num_tokens: int, num_bytes: int) -> list[bytes]:
        """Record a stored output; returns the hashes evicted to stay within the budget (never the
        one just inserted, even when it alone is over it: it is about to be read)."""
        old = self._entries.pop(mm_hash, None)
        if old is not None:
            self.num_bytes -= old[1]
        self._entries[mm_hash] = (num_tokens, num_bytes)
        self.num_bytes += num_bytes
        evicted: list[bytes] = []
        while self.num_bytes > self.capacity_bytes and len(self._entries) > 1:
            victim, (_, size) = self._entries.popitem(last=False)
            self.num_bytes -= size
            evicted.append(victim)
        self.num_evicted += len(evicted)
        return evicted

    def remove(self, mm_hash: bytes) -> None:
        """Forget an entry whose file is gone (removed by another encoder sharing the store)."""
        entry = self._entries.pop(mm_hash, None)
        if entry is not None:
            self.num_bytes -= entry[1]

    def check_integrity(self) -> None:
        assert self.num_bytes == sum(size for _, size in self._entries.values()), "byte count drifted"
        assert all(tokens > 0 and size > 0 for tokens, size in self._entries.values()), "empty entry"
        assert self.num_bytes <= self.capacity_bytes or len(self._entries) <= 1, "over budget"
        assert min(self.num_hits, self.num_misses, self.num_evicted) >= 0
