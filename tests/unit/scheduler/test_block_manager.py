from __future__ import annotations

import pytest

from libs.kvstore.block_hash import hash_blocks
from services.scheduler.block_manager import BlockManager, OutOfBlocks


def test_allocate_grow_free_keep_integrity() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    added = bm.allocate("a", 5)
    assert added == bm.block_tables["a"] and len(added) == 2
    bm.check_integrity()
    assert bm.allocate("a", 8) == []  # still fits in two blocks
    bm.allocate("b", 1)
    bm.check_integrity()
    assert bm.num_free_blocks == 1
    assert not bm.can_allocate("b", 9)
    assert bm.can_allocate("b", 8) and not bm.can_allocate("b", 8, reserve=1)
    with pytest.raises(OutOfBlocks):
        bm.allocate("b", 9)
    bm.check_integrity()
    bm.free("a")
    bm.check_integrity()
    assert bm.num_free_blocks == 3
    bm.free("unknown")
    bm.check_integrity()


def test_shared_blocks_return_when_the_last_owner_frees() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate("parent", 5)  # 3 blocks
    shared = bm.share("parent", "child", 2)
    assert shared == bm.block_tables["parent"][:2]
    bm.allocate("child", 6)  # one block of its own
    bm.check_integrity()
    assert bm.num_free_blocks == 2
    bm.free("parent")
    bm.check_integrity()
    assert bm.num_free_blocks == 3  # only the parent's unshared block came back
    bm.free("child")
    bm.check_integrity()
    assert bm.num_free_blocks == 6


def test_check_integrity_catches_a_double_owned_block() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    bm.allocate("a", 2)
    bm.block_tables["b"] = list(bm.block_tables["a"])  # bypasses the reference count
    with pytest.raises(AssertionError):
        bm.check_integrity()


# --- prefix cache ---------------------------------------------------------------------------


def hashes_of(tokens: list[int], tenant: str = "", block_size: int = 2) -> list[bytes]:
    return hash_blocks(tokens, block_size, "fp", tenant)


def test_freed_full_blocks_stay_cached_and_a_match_takes_them() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    bm.allocate("a", 5)  # 3 blocks, the last one partial
    bm.cache_blocks("a", hashes_of(tokens), 2)
    bm.check_integrity()
    table = list(bm.block_tables["a"])
    bm.free("a")
    bm.check_integrity()
    assert bm.prefix_cache.num_evictable_blocks == 2 and bm.num_free_blocks == 6
    assert bm.match("b", hashes_of([*tokens, 6]), 2) == 2
    bm.check_integrity()
    assert bm.block_tables["b"] == table[:2] and bm.num_cached_blocks_of("b") == 2
    assert bm.prefix_cache.num_evictable_blocks == 0 and bm.num_free_blocks == 4
    assert bm.match("c", hashes_of(tokens), 1) == 1  # a block two sequences hold
    assert bm.match("d", hashes_of(tokens, tenant="other"), 2) == 0  # another tenant's chain
    assert bm.match("e", hashes_of([1, 2, 9, 9]), 2) == 1  # the chain stops at the first miss
    bm.check_integrity()
    for seq_id in "bce":
        bm.free(seq_id)
        bm.check_integrity()
    assert bm.prefix_cache.num_evictable_blocks == 2


def test_allocation_takes_free_blocks_first_then_evicts_least_recently_used() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    for seq_id, tokens in (("a", [1, 2, 3, 4]), ("b", [5, 6])):
        bm.allocate(seq_id, len(tokens))
        bm.cache_blocks(seq_id, hashes_of(tokens), len(tokens) // 2)
    a_table, (b_block,) = list(bm.block_tables["a"]), bm.block_tables["b"]
    bm.free("a")  # its tail parks first, so it is evicted before its head
    bm.free("b")
    bm.check_integrity()
    (free_block,) = set(range(4)) - {*a_table, b_block}
    assert bm.allocate("c", 2) == [free_block]
    assert bm.prefix_cache.stats.num_evicted_blocks == 0
    assert bm.allocate("c", 6) == [a_table[1], a_table[0]]  # then LRU: a's tail, then a's head
    bm.check_integrity()
    assert bm.prefix_cache.stats.num_evicted_blocks == 2
    assert bm.match("d", hashes_of([1, 2, 3, 4]), 2) == 0  # a's chain is gone
    assert bm.match("e", hashes_of([5, 6, 7]), 1) == 1  # b's block survived
    bm.check_integrity()
    with pytest.raises(OutOfBlocks):
        bm.allocate("f", 2)


def test_a_hash_already_cached_leaves_the_duplicate_block_uncached() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    for seq_id in "ab":  # both computed the same block
        bm.allocate(seq_id, 2)
        bm.cache_blocks(seq_id, hashes_of([7, 8]), 1)
    bm.check_integrity()
    assert bm.prefix_cache.num_cached_blocks == 1
    bm.free("b")
    bm.check_integrity()
    assert bm.prefix_cache.num_evictable_blocks == 0  # b's copy went back to the free list
    bm.free("a")
    assert bm.prefix_cache.num_evictable_blocks == 1


def test_check_integrity_catches_a_free_block_that_is_still_cached() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    bm.allocate("a", 2)
    bm.cache_blocks("a", hashes_of([1, 2]), 1)
    bm.block_tables.pop("a")
    bm._ref_counts[0] = 0
    bm._free.append(0)  # freed behind the cache's back
    with pytest.raises(AssertionError):
        bm.check_integrity()
