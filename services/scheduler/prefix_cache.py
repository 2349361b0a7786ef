"""G1 prefix cache of one worker's logical KV blocks: which full block holds the KV of which chained
block hash, and which of those blocks nobody holds any more (evictable, least recently used first).

Pure: no torch. The key is ``libs.kvstore.block_hash`` (parent hash, the block's tokens, the model
fingerprint, the tenant salt), so a hit means the block holds exactly the KV of that token prefix,
for that model and that tenant. The BlockManager owns reference counts, the free list and block
tables and asks this map what to reuse and what to evict; ``BlockHasher`` grows a sequence's chain
of block hashes as its known tokens fill blocks.

Invariants (``check_integrity``): the hash -> block and block -> hash maps are inverse; every
evictable block is cached. The BlockManager adds: an evictable block has no owner, a free block is
not cached, and no block is both free and evictable.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from libs.kvstore.block_hash import BLOCK_HASH_NUM_BYTES, hash_blocks
from libs.protocol.messages import ImageSpan
from services.scheduler.sequence import Sequence


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters since start; the scheduler records a query when it admits a sequence."""

    num_queries: int = 0  # admissions that looked the cache up
    num_query_tokens: int = 0  # tokens those sequences held (vLLM's "queries")
    num_hit_tokens: int = 0  # tokens whose KV came from the cache
    num_evicted_blocks: int = 0  # cached blocks handed out again, their hash dropped

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queries += 1
        self.num_query_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens


MAX_JOURNAL_LEN = 1 << 16  # events kept for the publisher; past it, it publishes a gap instead


class PrefixCache:
    """``take_events`` hands out the hashes cached and dropped since its last call, in order
    (the G1 events the scheduler publishes for routers: BlockStored / BlockRemoved)."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}  # block hash -> the block holding its KV
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unowned; LRU first
        self.stats = PrefixCacheStats()
        self._journal: list[tuple[bool, bytes]] = []  # (stored, hash), oldest first
        self._journal_overflowed = False  # events were dropped: consumers must resync

    def take_events(self) -> tuple[list[tuple[bool, bytes]], bool]:
        """(stored?, hash) per change since the last call, oldest first, and whether some were
        dropped (the journal was full: nobody took them)."""
        events, overflowed = self._journal, self._journal_overflowed
        self._journal, self._journal_overflowed = [], False
        return events, overflowed

    def cached_hashes(self) -> list[bytes]:
        """Every hash cached now (a dump of G1)."""
        return list(self._block_of)

    def _note(self, stored: bool, block_hash: bytes) -> None:
        if len(self._journal) < MAX_JOURNAL_LEN:
            self._journal.append((stored, block_hash))
        else:
            self._journal_overflowed = True

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hash_of.get(block_id)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def lookup(self, block_hashes: Seq[bytes], max_blocks: int) -> list[int]:
        """The blocks of the longest prefix of ``block_hashes[:max_blocks]`` that is cached."""
        hits: list[int] = []
        for block_hash in itertools.islice(block_hashes, max_blocks):
            block_id = self._block_of.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def insert(self, block_id: int, block_hash: bytes) -> None:
        """Cache a held block under its hash; a hash another block already holds is left there
        (two sequences computed the same block: only the first is found, the other is freed)."""
        current = self._hash_of.get(block_id)
        if current is not None:
            assert current == block_hash, f"block {block_id} cached under two hashes"
            return
        if block_hash not in self._block_of:
            self._block_of[block_hash] = block_id
            self._hash_of[block_id] = block_hash
            self._note(True, block_hash)

    def park(self, block_id: int) -> bool:
        """The block's last owner let go: a cached block becomes evictable (most recently used),
        and True; an uncached one is the caller's to free, and False."""
        if block_id not in self._hash_of:
            return False
        self._evictable[block_id] = None
        return True

    def unpark(self, block_id: int) -> None:
        """A hit takes an evictable block: it has an owner again."""
        del self._evictable[block_id]

    def forget(self, block_id: int) -> None:
        """Drop an unowned block's hash: its KV may never have been written (its sequence failed)."""
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:
            del self._block_of[block_hash]
            self._note(False, block_hash)
        self._evictable.pop(block_id, None)

    def evict(self) -> int:
        """The least recently used evictable block, its hash dropped: the caller overwrites it."""
        block_id, _ = self._evictable.popitem(last=False)
        block_hash = self._hash_of.pop(block_id)
        del self._block_of[block_hash]
        self._note(False, block_hash)
        self.stats.num_evicted_blocks += 1
        return block_id

    def evictable_block_ids(self) -> set[int]:
        return set(self._evictable)

    def check_integrity(self) -> None:
        assert len(self._block_of) == len(self._hash_of), "hash maps differ in size"
        for block_hash, block_id in self._block_of.items():
            assert self._hash_of.get(block_id) == block_hash, "hash maps are not inverse"
            assert len(block_hash) == BLOCK_HASH_NUM_BYTES, "a cached hash has the wrong size"
        assert all(b in self._hash_of for b in self._evictable), "an evictable block is not cached"
        stats = self.stats
        assert 0 <= stats.num_hit_tokens <= stats.num_query_tokens and stats.num_evicted_blocks >= 0


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Grows each sequence's chain of full-block hashes (prompt, then output tokens, salted with
    the sequence's tenant) as far as asked: blocks already hashed are never hashed again."""

    block_size: int
    model_fingerprint: str

    def extend(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """``seq.block_hashes`` holding at least its first ``num_blocks`` full blocks."""
        have = len(seq.block_hashes)
        if have < num_blocks:
            assert num_blocks * self.block_size <= seq.num_tokens, "hashing a block that is not full"
            tokens = seq.token_ids(have * self.block_size, num_blocks * self.block_size)
            parent = seq.block_hashes[-1] if have else None
            seq.block_hashes += hash_blocks(
                tokens,
                self.block_size,
                self.model_fingerprint,
                seq.tenant,
                parent,
                seq.image_spans,
                have * self.block_size,
            )
        return seq.block_hashes

    def chain(self, token_ids: Seq[int], tenant: str, spans: Seq[ImageSpan] = ()) -> list[bytes]:
        """The hashes of the full blocks of ``token_ids`` under ``tenant``, with the prompt's
        images (a prompt not yet a Sequence: routing and G3 lookups hash it before it is queued)."""
        return hash_blocks(token_ids, self.block_size, self.model_fingerprint, tenant, spans=spans)

    def check(self, seq: Sequence) -> None:
        """The chain is the hash of the sequence's tokens (integrity checks; rehashes everything)."""
        if not seq.block_hashes:
            return
        tokens = seq.token_ids(0, len(seq.block_hashes) * self.block_size)
        want = hash_blocks(tokens, self.block_size, self.model_fingerprint, seq.tenant, spans=seq.image_spans)
        assert seq.block_hashes == want, f"{seq.seq_id}: block hashes disagree with its tokens"
