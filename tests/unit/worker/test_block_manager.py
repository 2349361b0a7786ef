from __future__ import annotations

import pytest

from services.worker.block_manager import BlockManager, OutOfBlocks


def test_allocate_grow_free_keep_integrity() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate("a", 5) == bm.block_tables["a"] and len(bm.block_tables["a"]) == 2
    bm.check_integrity()
    bm.allocate("a", 8)  # still fits in two blocks
    assert len(bm.block_tables["a"]) == 2
    bm.allocate("b", 1)
    bm.check_integrity()
    assert bm.num_free_blocks == 1
    assert not bm.can_allocate("b", 9)
    with pytest.raises(OutOfBlocks):
        bm.allocate("b", 9)
    bm.check_integrity()
    a0, a1 = bm.block_tables["a"]
    assert bm.slot("a", 0) == a0 * 4 and bm.slot("a", 6) == a1 * 4 + 2
    bm.free("a")
    bm.check_integrity()
    assert bm.num_free_blocks == 3
    bm.free("unknown")
    bm.check_integrity()
