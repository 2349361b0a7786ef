from __future__ import annotations

import time

import pytest

from libs.kvstore.retention import RetentionClass, RetentionPolicy
from services.kvcache.index import BlockIndex, Placement, Tier

FP = "m"
POLICY = RetentionPolicy(
    [RetentionClass("agent", 30.0, 0), RetentionClass("chat", 70.0, 1), RetentionClass("batch", 10.0, 0)]
)


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def g3(size: int = 10, name: str = "f") -> Placement:
    return Placement(Tier.G3, name, size, FP)


def test_insert_lookup_longest_prefix_and_totals() -> None:
    index = BlockIndex(POLICY)
    for i in range(3):
        assert index.insert(h(i), g3(10 + i), now=100.0) is None
    index.insert(h(9), Placement(Tier.G2, 7, 5, FP), now=100.0, retention_class="chat")
    index.check_integrity()
    assert [e.block_hash for e in index.lookup_longest_prefix([h(0), h(1), h(5), h(2)])] == [h(0), h(1)]
    assert index.lookup_longest_prefix([h(5), h(0)]) == []
    assert len(index.lookup_longest_prefix([h(0), h(1), h(2), h(9)])) == 4
    assert index.lookup_longest_prefix([h(0), h(1)], now=130.0) == []  # agent: 30 s
    totals = index.totals()
    assert totals.num_blocks_by_tier == {Tier.G3: 3, Tier.G2: 1}
    assert totals.num_bytes_by_tier == {Tier.G3: 33, Tier.G2: 5}
    assert totals.num_blocks_by_class == {"agent": 3, "chat": 1}
    assert totals.num_bytes_by_class == {"agent": 33, "chat": 5}
    assert index.num_bytes(Tier.G3) == 33 and len(index) == 4 and h(9) in index


def test_touch_extends_expiry_and_upgrades_class_but_never_weakens() -> None:
    index = BlockIndex(POLICY)
    index.insert(h(1), g3(), now=0.0)
    entry = index.touch(h(1), now=20.0)
    assert entry is not None and entry.expires_at == 50.0 and entry.last_use == 20.0
    entry = index.touch(h(1), now=25.0, retention_class="chat")
    assert entry is not None and entry.retention_class == "chat" and entry.expires_at == 95.0
    entry = index.touch(h(1), now=10.0, retention_class="agent")  # a late event: nothing weakens
    assert entry is not None
    assert (entry.retention_class, entry.last_use, entry.expires_at) == ("chat", 25.0, 95.0)
    assert index.touch(h(2), now=0.0) is None
    index.check_integrity()


def test_reinsert_moves_tiers_and_returns_the_old_entry() -> None:
    index = BlockIndex(POLICY)
    index.insert(h(1), Placement(Tier.G2, 3, 8, FP), now=0.0, retention_class="chat")
    old = index.insert(h(1), g3(20, "/store/x.kvb"), now=5.0)
    assert old is not None and old.placement.tier is Tier.G2
    entry = index.get(h(1))
    assert entry is not None and entry.placement.tier is Tier.G3 and entry.retention_class == "chat"
    assert index.totals().num_bytes_by_tier == {Tier.G2: 0, Tier.G3: 20}
    index.check_integrity()


def test_expire_removes_exactly_the_expired_of_a_tier() -> None:
    index = BlockIndex(POLICY)
    index.insert(h(1), g3(), now=0.0, retention_class="batch")  # expires at 10
    index.insert(h(2), g3(), now=0.0)  # 30
    index.insert(h(3), Placement(Tier.G2, 0, 1, FP), now=0.0, retention_class="batch")
    assert [e.block_hash for e in index.expire(10.0, Tier.G3)] == [h(1)]
    assert [e.block_hash for e in index.expire(10.0)] == [h(3)]
    assert index.expire(29.9) == []
    index.check_integrity()


def test_evict_for_order_expired_then_class_then_recency_and_soft_priority() -> None:
    index = BlockIndex(POLICY)
    index.insert(h(1), g3(), now=0.0, retention_class="chat")  # expires 70; oldest of all
    index.insert(h(2), g3(), now=10.0)  # agent, expires 40
    index.insert(h(3), g3(), now=5.0)  # agent, expires 35: older than h(2)
    index.insert(h(4), g3(), now=1.0, retention_class="batch")  # expires 11
    index.insert(h(5), g3(), now=2.0, retention_class="chat")
    victims = index.evict_for(bytes_needed=10, capacity_bytes=30, now=20.0)
    assert [e.block_hash for e in victims] == [h(4), h(3), h(2)]
    # nothing of a lower class is left: the chat blocks go too (soft, not pinned), oldest first
    victims = index.evict_for(bytes_needed=20, capacity_bytes=20, now=20.0)
    assert [e.block_hash for e in victims] == [h(1), h(5)]
    assert len(index) == 0
    index.check_integrity()
    with pytest.raises(ValueError):
        index.evict_for(bytes_needed=21, capacity_bytes=20, now=20.0)


def test_stale_heap_items_are_compacted() -> None:
    index = BlockIndex(POLICY)
    for i in range(10):
        index.insert(h(i), g3(), now=0.0)
    for t in range(5_000):
        index.touch(h(t % 10), now=float(t))
    index.check_integrity()
    assert index._num_heap_items <= 64  # two live items per entry, plus at most the slack


def test_evicting_from_a_big_index_is_fast() -> None:
    index = BlockIndex(POLICY)
    for i in range(20_000):
        index.insert(h(i), g3(1), now=float(i % 997), retention_class="chat" if i % 3 else "agent")
    start = time.perf_counter()
    num_evicted = 0
    for step in range(2_000):  # one block at a time, as a store that stays full evicts
        num_evicted += len(index.evict_for(1, 20_000 - step, now=5.0))
    elapsed = time.perf_counter() - start
    assert num_evicted == 2_000 and len(index) == 18_000
    assert elapsed < 0.5, f"{elapsed:.3f} s"  # O(log n) per victim; a re-sort per call takes far longer
    index.check_integrity()


def test_check_integrity_catches_drift() -> None:
    index = BlockIndex(POLICY)
    index.insert(h(1), g3(), now=0.0)
    index._num_bytes_by_tier[Tier.G3] += 1
    with pytest.raises(AssertionError):
        index.check_integrity()
    index = BlockIndex(POLICY)
    index.insert(h(1), g3(), now=0.0)
    index._expiry[Tier.G3].clear()
    with pytest.raises(AssertionError):
        index.check_integrity()


def test_bad_inputs() -> None:
    index = BlockIndex(POLICY)
    with pytest.raises(ValueError):
        index.insert(h(1), g3(-1), now=0.0)
    with pytest.raises(ValueError):
        index.insert(h(1), g3(), now=float("nan"))
    with pytest.raises(ValueError):
        index.insert(h(1), g3(), now=0.0, retention_class="forever")
    assert len(index) == 0
    index.check_integrity()
