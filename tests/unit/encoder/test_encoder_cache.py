"""The encoder cache's bookkeeping: least recently used goes first, within the byte budget; an
output used within the minimum age is never a victim; a lookup or a touch makes an entry recent."""

from __future__ import annotations

import pytest

from services.encoder.encoder_cache import EncoderCache


def test_least_recently_used_are_the_victims_once_old_enough() -> None:
    cache = EncoderCache(300, min_age_s=10)
    for i, name in enumerate((b"a", b"b", b"c", b"d")):
        cache.insert(name, 16, 100, now=float(i))
        cache.check_integrity()
    assert cache.lookup(b"a", now=5.0) == 16  # a is now the most recently used
    cache.check_integrity()
    assert cache.victims(now=6.0) == []  # over budget, but everything was used within 10 s
    assert cache.victims(now=11.5) == [b"b"]  # 400 bytes: the least recently used one goes
    cache.remove(b"b", evicted=True)
    cache.check_integrity()
    assert cache.victims(now=100.0) == [] and cache.num_bytes == 300
    assert cache.lookup(b"b", now=100.0) is None
    assert (cache.num_hits, cache.num_misses, cache.num_evicted) == (1, 1, 1)


def test_a_touch_from_another_encoder_moves_an_entry_back_in_order() -> None:
    cache = EncoderCache(150, min_age_s=0)
    cache.insert(b"old", 4, 100, now=1.0)
    cache.insert(b"new", 4, 100, now=2.0)
    cache.touch(b"old", when=3.0)  # its file was used later, by another encoder
    cache.check_integrity()
    assert cache.victims(now=4.0) == [b"new"]
    cache.touch(b"new", when=0.5)  # an older time never moves an entry back
    cache.check_integrity()
    assert cache.victims(now=4.0) == [b"new"]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        EncoderCache(0)
    with pytest.raises(ValueError):
        EncoderCache(100, min_age_s=-1)
