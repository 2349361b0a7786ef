"""The encoder cache's bookkeeping: least recently used goes first, within the byte budget, and a
lookup makes an entry recent."""

from __future__ import annotations

import pytest

from services.encoder.encoder_cache import EncoderCache


def test_least_recently_used_is_evicted_first() -> None:
    cache = EncoderCache(300)
    assert cache.insert(b"a", 16, 100) == [] and cache.insert(b"b", 16, 100) == []
    cache.check_integrity()
    assert cache.lookup(b"a") == 16  # a is now the most recent
    assert cache.insert(b"c", 16, 100) == []
    assert cache.insert(b"d", 16, 100) == [b"b"]  # over 300 bytes: the least recent goes
    cache.check_integrity()
    assert cache.lookup(b"b") is None and b"a" in cache and len(cache) == 3
    assert (cache.num_hits, cache.num_misses, cache.num_evicted) == (1, 1, 1)


def test_an_entry_larger_than_the_budget_stays_alone_until_read() -> None:
    cache = EncoderCache(100)
    cache.insert(b"a", 4, 50)
    assert cache.insert(b"big", 64, 500) == [b"a"]  # kept: it is about to be read
    cache.check_integrity()
    cache.remove(b"big")
    assert cache.num_bytes == 0 and len(cache) == 0
    cache.check_integrity()


def test_a_budget_must_be_positive() -> None:
    with pytest.raises(ValueError):
        EncoderCache(0)
