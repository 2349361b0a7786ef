"""Random start (prefix-cache match, then allocate) / grow / cache / share / free sequences on a
small BlockManager, against a model of what each KV block holds.

The model plays the worker: writing a sequence's tokens records, per block, the tenant and the
token prefix whose KV the block now holds. After every operation the manager's integrity holds,
every cached block holds exactly the prefix its hash stands for, a block is only written while its
one owner holds it uncached, and every match returns blocks holding the matcher's own prefix under
its own tenant. Three short texts share prefixes and two tenants share texts, so hits, misses,
duplicates and evictions under pressure all happen.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from libs.kvstore.block_hash import hash_blocks
from services.scheduler.block_manager import BlockManager

BLOCK_SIZE = 2
NUM_BLOCKS = 7
TEXTS = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [1, 2, 5, 5, 5, 5, 5, 5])
SEQ_IDS = ("a", "b", "c", "d")
TENANTS = ("", "t")

Meaning = tuple[str, tuple[int, ...]]  # (tenant, the token prefix whose KV ends in the block)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.tokens: dict[str, list[int]] = {}  # held sequences' tokens
        self.tenant: dict[str, str] = {}
        self.computed: dict[str, int] = {}  # tokens whose KV the sequence wrote or found
        self.content: dict[int, Meaning] = {}  # block -> what its KV is (the worker's pool)
        self.meaning: dict[bytes, Meaning] = {}  # block hash -> the prefix it stands for

    def hashes(self, seq_id: str) -> list[bytes]:
        tokens, tenant = self.tokens[seq_id], self.tenant[seq_id]
        hashes = hash_blocks(tokens, BLOCK_SIZE, "fp", tenant)
        for i, block_hash in enumerate(hashes):
            self.meaning[block_hash] = (tenant, tuple(tokens[: (i + 1) * BLOCK_SIZE]))
        return hashes

    def write(self, seq_id: str, end: int) -> None:
        """The worker computes the KV of tokens [computed, end) into the sequence's blocks."""
        table, tokens = self.bm.block_tables[seq_id], self.tokens[seq_id]
        for p in range(self.computed[seq_id], end):
            block_id = table[p // BLOCK_SIZE]
            assert self.bm.prefix_cache.hash_of(block_id) is None, "writing a cached block"
            assert sum(block_id in t for t in self.bm.block_tables.values()) == 1, "writing a shared block"
            self.content[block_id] = (self.tenant[seq_id], tuple(tokens[: p + 1]))
        self.computed[seq_id] = end

    def drop(self, seq_id: str) -> None:
        self.bm.free(seq_id)
        for d in (self.tokens, self.tenant, self.computed):
            d.pop(seq_id, None)

    @rule(
        seq_id=st.sampled_from(SEQ_IDS),
        text=st.sampled_from(TEXTS),
        length=st.integers(1, 8),
        tenant=st.sampled_from(TENANTS),
    )
    def start(self, seq_id: str, text: list[int], length: int, tenant: str) -> None:
        """Admission: take the longest cached prefix (never the last token's block), then the rest."""
        if seq_id in self.tokens:
            return
        self.tokens[seq_id], self.tenant[seq_id] = text[:length], tenant
        hashes = self.hashes(seq_id)
        num_hit = self.bm.match(seq_id, hashes, (length - 1) // BLOCK_SIZE)
        for i, block_id in enumerate(self.bm.block_tables.get(seq_id, [])):
            assert self.content[block_id] == self.meaning[hashes[i]], "a hit holds another prefix's KV"
        self.computed[seq_id] = num_hit * BLOCK_SIZE
        if not self.bm.can_allocate(seq_id, length):
            self.drop(seq_id)  # no room: gives the hit back, as admission does
            return
        self.bm.allocate(seq_id, length)
        self.write(seq_id, length)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(1, 3), min_size=1, max_size=4))
    def grow(self, data: st.DataObject, new_tokens: list[int]) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        end = len(self.tokens[seq_id]) + len(new_tokens)
        if not self.bm.can_allocate(seq_id, end):
            self.drop(seq_id)  # preempted
            return
        self.tokens[seq_id] += new_tokens
        self.bm.allocate(seq_id, end)
        self.write(seq_id, end)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.cache_blocks(seq_id, self.hashes(seq_id), self.computed[seq_id] // BLOCK_SIZE)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), dst=st.sampled_from(SEQ_IDS))
    def share(self, data: st.DataObject, dst: str) -> None:
        """A second choice of the same request takes the full blocks of its sibling's prompt."""
        src = data.draw(st.sampled_from(sorted(self.tokens)))
        if dst in self.tokens:
            return
        num_blocks = (len(self.tokens[src]) - 1) // BLOCK_SIZE
        self.bm.share(src, dst, num_blocks)
        self.tokens[dst], self.tenant[dst] = list(self.tokens[src]), self.tenant[src]
        self.computed[dst] = num_blocks * BLOCK_SIZE
        if not self.bm.can_allocate(dst, len(self.tokens[dst])):
            self.drop(dst)
            return
        self.bm.allocate(dst, len(self.tokens[dst]))
        self.write(dst, len(self.tokens[dst]))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), cache_first=st.booleans())
    def free(self, data: st.DataObject, cache_first: bool) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        if cache_first:  # what the scheduler does when a sequence finishes or is preempted
            self.bm.cache_blocks(seq_id, self.hashes(seq_id), self.computed[seq_id] // BLOCK_SIZE)
        self.drop(seq_id)

    @invariant()
    def integrity(self) -> None:
        self.bm.check_integrity()
        assert set(self.bm.block_tables) <= set(self.tokens)
        for block_id in range(NUM_BLOCKS):
            block_hash = self.bm.prefix_cache.hash_of(block_id)
            if block_hash is not None:
                assert self.content.get(block_id) == self.meaning[block_hash], "a cached block holds other KV"
        stats = self.bm.prefix_cache.stats
        assert stats.num_evicted_blocks >= 0


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
