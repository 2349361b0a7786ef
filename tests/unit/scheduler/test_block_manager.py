from __future__ import annotations

import pytest

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
