"""HostCache (G2) against a plain LRU model: random put / put_many / get / gather / touch / clear
sequences, with ``check_integrity`` after every operation, the payloads read back exactly, and
eviction always taking the least recently used block that the operation itself did not name."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from services.worker.host_cache import HostCache

SHAPE = (2, 2, 1, 1, 3)  # [num_layers, 2, block_size, num_kv_heads, head_dim]
CAPACITY = 4
hashes = st.integers(0, 7).map(lambda i: i.to_bytes(32, "big"))
values = st.floats(-100, 100, allow_nan=False, width=32)


def payload(value: float) -> torch.Tensor:
    return torch.full(SHAPE, value, dtype=torch.float32)


class HostCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = HostCache(CAPACITY, SHAPE, torch.float32)
        self.model: OrderedDict[bytes, float] = OrderedDict()  # least recently used first

    def model_put_many(self, items: list[tuple[bytes, float]]) -> tuple[list[bytes], list[bytes]]:
        held = [h for h in dict.fromkeys(h for h, _ in items) if h in self.model]
        for h in held:
            self.model.move_to_end(h)
        room = CAPACITY - len(held)
        stored: list[bytes] = []
        evicted: list[bytes] = []
        for h, value in items:
            if h in self.model or len(stored) == room:
                continue
            if len(self.model) == CAPACITY:
                evicted.append(self.model.popitem(last=False)[0])
            self.model[h] = value
            stored.append(h)
        return stored, evicted

    @rule(block_hash=hashes, value=values)
    def put(self, block_hash: bytes, value: float) -> None:
        assert self.cache.put(block_hash, payload(value)) == self.model_put_many([(block_hash, value)])

    @rule(items=st.lists(st.tuples(hashes, values), max_size=7))
    def put_many(self, items: list[tuple[bytes, float]]) -> None:
        stacked = torch.stack([payload(v) for _, v in items]) if items else torch.empty((0, *SHAPE))
        got = self.cache.put_many([h for h, _ in items], stacked)
        assert got == self.model_put_many(items)

    @rule(block_hash=hashes)
    def get(self, block_hash: bytes) -> None:
        got = self.cache.get(block_hash)
        assert (got is None) == (block_hash not in self.model)
        if got is not None:
            assert torch.equal(got, payload(self.model[block_hash]))
            self.model.move_to_end(block_hash)

    @rule(data=st.data())
    def gather(self, data: st.DataObject) -> None:
        if not self.model:
            return
        chosen = data.draw(st.lists(st.sampled_from(list(self.model)), max_size=5))
        got = self.cache.gather(chosen)
        assert got.shape == (len(chosen), *SHAPE)
        for row, h in zip(got, chosen, strict=True):
            assert torch.equal(row, payload(self.model[h]))
            self.model.move_to_end(h)

    @rule(chosen=st.lists(hashes, max_size=4))
    def touch(self, chosen: list[bytes]) -> None:
        self.cache.touch(chosen)
        for h in chosen:
            if h in self.model:
                self.model.move_to_end(h)

    @rule()
    def clear(self) -> None:
        assert sorted(self.cache.clear()) == sorted(self.model)
        self.model.clear()

    @invariant()
    def matches_the_model(self) -> None:
        self.cache.check_integrity()
        assert self.cache.hashes() == list(self.model)
        assert len(self.cache) == len(self.model)
        assert all(h in self.cache for h in self.model)


TestHostCache = HostCacheMachine.TestCase
TestHostCache.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_counters_and_a_batch_larger_than_the_pool_keeps_its_head() -> None:
    cache = HostCache(2, SHAPE, torch.float32)
    chain = [bytes([i]) * 32 for i in range(3)]
    stored, evicted = cache.put_many(chain, torch.stack([payload(i) for i in range(3)]))
    cache.check_integrity()
    assert stored == chain[:2] and evicted == []  # the head of a chain is what a load can use
    stored, evicted = cache.put(chain[2], payload(2))
    cache.check_integrity()
    assert stored == [chain[2]] and evicted == [chain[0]]
    assert cache.num_stored_blocks == 3 and cache.num_evicted_blocks == 1
    got = cache.get(chain[1])
    assert got is not None and torch.equal(got, payload(1)) and cache.num_hit_blocks == 1
    with pytest.raises(ValueError, match="do not fit"):
        cache.put_many(chain[:1], torch.zeros((1, 3)))
    cache.check_integrity()
