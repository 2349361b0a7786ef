"""The encoder cache's bookkeeping: which images' outputs are stored, in least-recently-used
order, within a byte budget. Pure: the service removes the files of what it evicts.

An output is used when a request names its image (a hit) and when it is written. The budget is
in bytes of the stored outputs, as vLLM's encoder cache counts embedding tokens: an image costs
its rows times the hidden size times the element size. An output used within ``min_age_s`` is
never a victim, even over budget: the request that asked for it may not have been prefilled yet
(it waits in a queue, or is preempted or moved, and its worker reads the output then).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class _Entry:
    num_tokens: int
    num_bytes: int
    used_at: float  # wall-clock seconds: comparable with the files' times, which other encoders touch


class EncoderCache:
    def __init__(self, capacity_bytes: int, min_age_s: float = 600.0) -> None:
        if capacity_bytes <= 0 or min_age_s < 0:
            raise ValueError(f"encoder cache: capacity {capacity_bytes} bytes must be > 0, min age >= 0")
        self.capacity_bytes = capacity_bytes
        self.min_age_s = min_age_s
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, mm_hash: bytes) -> bool:
        return mm_hash in self._entries

    def lookup(self, mm_hash: bytes, now: float) -> int | None:
        """Its number of tokens (it is now the most recently used), or None: not cached."""
        entry = self._entries.get(mm_hash)
        if entry is None:
            self.num_misses += 1
            return None
        self.touch(mm_hash, now)
        self.num_hits += 1
        return entry.num_tokens

    def insert(self, mm_hash: bytes, num_tokens: int, num_bytes: int, now: float) -> None:
        """Record a stored output, used at ``now``."""
        self.remove(mm_hash)
        self._entries[mm_hash] = _Entry(num_tokens, num_bytes, now)
        self.num_bytes += num_bytes

    def touch(self, mm_hash: bytes, when: float) -> None:
        """It was used at ``when`` (here, or by another encoder: its file's time); kept in order."""
        entry = self._entries.pop(mm_hash)
        entry.used_at = max(entry.used_at, when)
        # The entries used later than it are a suffix (the order is by use): they go after it. A
        # use now (a hit, the common case) has none, and costs one step.
        later = list(
            itertools.takewhile(lambda h: self._entries[h].used_at > entry.used_at, reversed(self._entries))
        )
        self._entries[mm_hash] = entry
        for h in reversed(later):
            self._entries.move_to_end(h)

    def victims(self, now: float) -> list[bytes]:
        """Least recently used first, the entries to evict to come back within the budget: only
        those unused for ``min_age_s`` (none: over budget until they age). Not removed here."""
        out: list[bytes] = []
        excess = self.num_bytes - self.capacity_bytes
        for mm_hash, entry in self._entries.items():
            if excess <= 0 or now - entry.used_at < self.min_age_s:
                break
            out.append(mm_hash)
            excess -= entry.num_bytes
        return out

    def remove(self, mm_hash: bytes, evicted: bool = False) -> None:
        """Forget an entry (``evicted``: its file removed to keep the budget)."""
        entry = self._entries.pop(mm_hash, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes
            self.num_evicted += evicted

    def check_integrity(self) -> None:
        entries = list(self._entries.values())
        assert self.num_bytes == sum(e.num_bytes for e in entries), "byte count drifted"
        assert all(e.num_tokens > 0 and e.num_bytes > 0 for e in entries), "empty entry"
        assert all(a.used_at <= b.used_at for a, b in itertools.pairwise(entries)), "not in LRU order"
        assert min(self.num_hits, self.num_misses, self.num_evicted) >= 0
