"""The long-term block index: block hash -> where the block's KV is stored, and for how long.

Pure: no clock, no I/O. Every call that depends on time takes ``now`` (unix seconds) from the caller.
One index describes one store root and the G2 host tiers that report to the same kvcache service; a
hash names one block of one model under one tenant (see ``libs.kvstore.block_hash``), so entries of
different models never collide and ``lookup_longest_prefix`` needs no model filter.

Eviction follows ``retention.eviction_key`` (expired first, then the lower-priority class, then the
least recently used) with lazy heaps, so one victim costs O(log n) however big the index:

    _expiry[tier]             heap of (expires_at, seq, block_hash)
    _lru[(tier, priority)]    heap of (last_use,   seq, block_hash)

Each entry state has one ``seq``; a heap item is live iff ``_seqs[block_hash] == seq``. A touch,
a re-insert or a removal leaves the old items behind as stale ones, which are skipped when they
reach the top and dropped by a compaction once stale items outnumber live ones.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Final

from libs.kvstore.retention import RetentionPolicy, eviction_key

_HeapItem = tuple[float, int, bytes]  # (time, seq, block_hash)
_MIN_COMPACT_ITEMS: Final = 64


class Tier(enum.Enum):
    G2 = "G2"  # host memory of one worker; location is the worker's slot or handle
    G3 = "G3"  # the shared store; location is the block file's path


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one block's KV lies and what it costs there."""

    tier: Tier
    location: str | int
    size_bytes: int  # G3: the whole file (header + payload), what the store's capacity is charged
    fingerprint: str  # the model the KV belongs to


@dataclass(frozen=True, slots=True)
class BlockEntry:
    block_hash: bytes
    placement: Placement
    retention_class: str
    last_use: float
    expires_at: float


@dataclass(frozen=True, slots=True)
class IndexTotals:
    num_blocks_by_tier: dict[Tier, int]
    num_bytes_by_tier: dict[Tier, int]
    num_blocks_by_class: dict[str, int]
    num_bytes_by_class: dict[str, int]


class BlockIndex:
    def __init__(self, policy: RetentionPolicy) -> None:
        self.policy = policy
        self._entries: dict[bytes, BlockEntry] = {}
        self._seqs: dict[bytes, int] = {}
        self._next_seq = 0
        self._expiry: dict[Tier, list[_HeapItem]] = {tier: [] for tier in Tier}
        self._lru: dict[tuple[Tier, int], list[_HeapItem]] = {}
        self._num_heap_items = 0
        self._num_blocks_by_tier: Counter[Tier] = Counter()
        self._num_bytes_by_tier: Counter[Tier] = Counter()
        self._num_blocks_by_class: Counter[str] = Counter()
        self._num_bytes_by_class: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def get(self, block_hash: bytes) -> BlockEntry | None:
        return self._entries.get(block_hash)

    def entries(self, tier: Tier | None = None) -> Iterator[BlockEntry]:
        return (e for e in list(self._entries.values()) if tier is None or e.placement.tier is tier)

    def num_bytes(self, tier: Tier) -> int:
        return self._num_bytes_by_tier[tier]

    def totals(self) -> IndexTotals:
        return IndexTotals(
            dict(self._num_blocks_by_tier),
            dict(self._num_bytes_by_tier),
            dict(self._num_blocks_by_class),
            dict(self._num_bytes_by_class),
        )

    # -- updates ----------------------------------------------------------------------------------

    def insert(
        self,
        block_hash: bytes,
        placement: Placement,
        now: float,
        retention_class: str | None = None,
        *,
        expires_at: float | None = None,
    ) -> BlockEntry | None:
        """Record that ``block_hash`` is stored at ``placement``; returns the entry it replaces.

        ``retention_class`` None means the policy's default; ``expires_at`` None means
        ``now + ttl`` (a rebuild passes the time its file's header promised). Re-inserting a known
        hash moves it (a new tier or location) but never weakens it: it keeps the stronger class,
        the later expiry and the later last use.
        """
        if placement.size_bytes < 0:
            raise ValueError(f"size_bytes={placement.size_bytes} must be >= 0")
        if math.isnan(now) or (expires_at is not None and math.isnan(expires_at)):
            raise ValueError("now and expires_at must be numbers")  # NaN would break heap order
        cls = self.policy.get(retention_class) if retention_class is not None else self.policy.default
        entry = BlockEntry(
            block_hash, placement, cls.name, now, cls.expires_at(now) if expires_at is None else expires_at
        )
        old = self._drop(block_hash)
        if old is not None:
            entry = self._merged(old, entry)
        self._add(entry)
        return old

    def touch(self, block_hash: bytes, now: float, retention_class: str | None = None) -> BlockEntry | None:
        """Mark a use: the block's expiry moves to ``now + ttl`` (never earlier) of the stronger of
        its class and ``retention_class``. Returns the updated entry, or None if absent."""
        old = self._entries.get(block_hash)
        if old is None:
            return None
        cls = self.policy.get(retention_class or old.retention_class)
        claim = BlockEntry(block_hash, old.placement, cls.name, now, cls.expires_at(now))
        self._drop(block_hash)
        entry = self._merged(old, claim)
        self._add(entry)
        return entry

    def remove(self, block_hash: bytes) -> BlockEntry | None:
        return self._drop(block_hash)

    def _merged(self, old: BlockEntry, new: BlockEntry) -> BlockEntry:
        cls = self.policy.stronger(self.policy.get(old.retention_class), self.policy.get(new.retention_class))
        return replace(
            new,
            retention_class=cls.name,
            last_use=max(old.last_use, new.last_use),  # an event that arrives late never ages a block
            expires_at=max(old.expires_at, new.expires_at),
        )

    # -- queries and eviction ---------------------------------------------------------------------

    def lookup_longest_prefix(
        self, block_hashes: Iterable[bytes], now: float | None = None
    ) -> list[BlockEntry]:
        """Entries of the leading ``block_hashes`` that are stored, up to the first that is not
        (or, given ``now``, has expired); its length is the number of reusable blocks."""
        found: list[BlockEntry] = []
        for block_hash in block_hashes:
            entry = self._entries.get(block_hash)
            if entry is None or (now is not None and entry.expires_at <= now):
                break
            found.append(entry)
        return found

    def expire(self, now: float, tier: Tier | None = None) -> list[BlockEntry]:
        """Remove and return every entry (of ``tier``, or all) whose expiry is ``<= now``, each tier
        earliest expiry first."""
        expired: list[BlockEntry] = []
        for t in Tier if tier is None else (tier,):
            heap = self._expiry[t]
            while (top := self._peek(heap)) is not None and top[0] <= now:
                heapq.heappop(heap)
                self._num_heap_items -= 1
                expired.append(self._drop_live(top[2]))
        return expired

    def evict_for(
        self, bytes_needed: int, capacity_bytes: int, now: float, tier: Tier = Tier.G3
    ) -> list[BlockEntry]:
        """Remove entries of ``tier`` until ``bytes_needed`` more fit in ``capacity_bytes``; returns
        them in policy order. Every expired entry goes (expired blocks hold space on no claim), then
        the lowest-priority class's least recently used, then the next class's (soft priority)."""
        if not 0 <= bytes_needed <= capacity_bytes:
            raise ValueError(f"bytes_needed={bytes_needed} must be in [0, capacity {capacity_bytes}]")
        victims = self.expire(now, tier)
        victims.sort(key=lambda e: self._key(e, now))  # stable: ties keep expiry order
        for priority in sorted(p for t, p in self._lru if t is tier):
            heap = self._lru[(tier, priority)]
            while self._num_bytes_by_tier[tier] + bytes_needed > capacity_bytes:
                top = self._peek(heap)
                if top is None:
                    break
                heapq.heappop(heap)
                self._num_heap_items -= 1
                victims.append(self._drop_live(top[2]))
        return victims

    def _key(self, entry: BlockEntry, now: float) -> tuple[bool, int, float]:
        priority = self.policy.get(entry.retention_class).priority
        return eviction_key(entry.expires_at, priority, entry.last_use, now)

    # -- bookkeeping ------------------------------------------------------------------------------

    def _add(self, entry: BlockEntry) -> None:
        block_hash, placement = entry.block_hash, entry.placement
        seq = self._next_seq
        self._next_seq += 1
        self._entries[block_hash] = entry
        self._seqs[block_hash] = seq
        priority = self.policy.get(entry.retention_class).priority
        heapq.heappush(self._expiry[placement.tier], (entry.expires_at, seq, block_hash))
        lru = self._lru.setdefault((placement.tier, priority), [])
        heapq.heappush(lru, (entry.last_use, seq, block_hash))
        self._num_heap_items += 2
        self._count(entry, +1)
        if self._num_heap_items > max(_MIN_COMPACT_ITEMS, 4 * len(self._entries)):
            self._compact()

    def _drop(self, block_hash: bytes) -> BlockEntry | None:
        """Forget an entry; its heap items turn stale."""
        if block_hash not in self._entries:
            return None
        return self._drop_live(block_hash)

    def _drop_live(self, block_hash: bytes) -> BlockEntry:
        entry = self._entries.pop(block_hash)
        del self._seqs[block_hash]
        self._count(entry, -1)
        return entry

    def _count(self, entry: BlockEntry, sign: int) -> None:
        tier, cls, size = entry.placement.tier, entry.retention_class, entry.placement.size_bytes
        self._num_blocks_by_tier[tier] += sign
        self._num_bytes_by_tier[tier] += sign * size
        self._num_blocks_by_class[cls] += sign
        self._num_bytes_by_class[cls] += sign * size

    def _is_live(self, item: _HeapItem) -> bool:
        return self._seqs.get(item[2]) == item[1]

    def _peek(self, heap: list[_HeapItem]) -> _HeapItem | None:
        """The live top of ``heap``, after popping the stale items above it."""
        while heap and not self._is_live(heap[0]):
            heapq.heappop(heap)
            self._num_heap_items -= 1
        return heap[0] if heap else None

    def _compact(self) -> None:
        """Drop every stale heap item: O(n), after at least n updates, so O(1) amortized."""
        for heap in (*self._expiry.values(), *self._lru.values()):
            heap[:] = [item for item in heap if self._is_live(item)]
            heapq.heapify(heap)
        self._num_heap_items = sum(len(h) for h in (*self._expiry.values(), *self._lru.values()))

    def check_integrity(self) -> None:
        """Counters, seqs and heaps agree with the entry map (O(n): tests and idle time only)."""
        assert self._entries.keys() == self._seqs.keys(), "entries and seqs disagree"
        blocks_by_tier: Counter[Tier] = Counter()
        bytes_by_tier: Counter[Tier] = Counter()
        blocks_by_class: Counter[str] = Counter()
        bytes_by_class: Counter[str] = Counter()
        want_expiry: set[tuple[Tier, _HeapItem]] = set()
        want_lru: set[tuple[tuple[Tier, int], _HeapItem]] = set()
        for block_hash, e in self._entries.items():
            assert e.block_hash == block_hash, "an entry is filed under another hash"
            assert e.placement.size_bytes >= 0
            tier, seq = e.placement.tier, self._seqs[block_hash]
            blocks_by_tier[tier] += 1
            bytes_by_tier[tier] += e.placement.size_bytes
            blocks_by_class[e.retention_class] += 1
            bytes_by_class[e.retention_class] += e.placement.size_bytes
            priority = self.policy.get(e.retention_class).priority
            want_expiry.add((tier, (e.expires_at, seq, block_hash)))
            want_lru.add(((tier, priority), (e.last_use, seq, block_hash)))
        assert blocks_by_tier == self._num_blocks_by_tier, "per-tier block counts drifted"
        assert bytes_by_tier == self._num_bytes_by_tier, "per-tier byte totals drifted"
        assert blocks_by_class == self._num_blocks_by_class, "per-class block counts drifted"
        assert bytes_by_class == self._num_bytes_by_class, "per-class byte totals drifted"
        heaps = [*self._expiry.values(), *self._lru.values()]
        assert all(_is_heap(h) for h in heaps), "a heap lost its order"
        assert self._num_heap_items == sum(len(h) for h in heaps), "heap item count drifted"
        live_expiry = [(t, i) for t, h in self._expiry.items() for i in h if self._is_live(i)]
        live_lru = [(k, i) for k, h in self._lru.items() for i in h if self._is_live(i)]
        assert len(live_expiry) == len(want_expiry) and set(live_expiry) == want_expiry, "expiry heaps"
        assert len(live_lru) == len(want_lru) and set(live_lru) == want_lru, "lru heaps"


def _is_heap(heap: list[_HeapItem]) -> bool:
    return all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap)))
