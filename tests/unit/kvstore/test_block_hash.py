from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.kvstore.block_hash import (
    BLOCK_HASH_NUM_BYTES,
    block_hash_from_hex,
    block_hash_hex,
    hash_block,
    hash_blocks,
    hash_packed_blocks,
    pack_token_ids,
)

FP = "smollm2-135m-q4_1"
token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=80)


def test_chain_property() -> None:
    tokens = list(range(100, 148))  # three blocks of 16
    hashes = hash_blocks(tokens, 16, FP, "t1")
    assert len(hashes) == 3 and all(len(h) == BLOCK_HASH_NUM_BYTES for h in hashes)
    parent = None
    for i, h in enumerate(hashes):
        assert hash_block(parent, tokens[16 * i : 16 * (i + 1)], FP, "t1") == h
        parent = h
    assert len(set(hashes)) == 3


@given(token_lists, token_lists, st.integers(1, 8))
def test_equal_hash_iff_equal_prefix(a: list[int], b: list[int], block_size: int) -> None:
    ha, hb = hash_blocks(a, block_size, FP), hash_blocks(b, block_size, FP)
    for i, (x, y) in enumerate(zip(ha, hb, strict=False)):
        # a block's hash commits to every token before its end, not only to its own block
        assert (x == y) == (a[: (i + 1) * block_size] == b[: (i + 1) * block_size])


def test_same_block_tokens_after_different_prefixes_hash_differently() -> None:
    a = hash_blocks([1, 2, 9, 9], 2, FP)
    b = hash_blocks([3, 4, 9, 9], 2, FP)
    assert a[1] != b[1]


def test_partial_last_block_has_no_hash() -> None:
    assert hash_blocks(list(range(15)), 16, FP) == []
    full = hash_blocks(list(range(32)), 16, FP)
    assert hash_blocks(list(range(47)), 16, FP) == full
    assert hash_blocks(list(range(48)), 16, FP)[:2] == full


def test_continuing_a_chain_from_a_parent_equals_hashing_it_whole() -> None:
    tokens = list(range(64))
    whole = hash_blocks(tokens, 8, FP, "s")
    head = hash_blocks(tokens[:24], 8, FP, "s")
    tail = hash_blocks(tokens[24:], 8, FP, "s", parent=head[-1])
    assert head + tail == whole


def test_salt_isolates_tenants_and_fingerprint_isolates_models() -> None:
    tokens = list(range(64))
    base = set(hash_blocks(tokens, 16, FP, "tenant-a"))
    assert base.isdisjoint(hash_blocks(tokens, 16, FP, "tenant-b"))
    assert base.isdisjoint(hash_blocks(tokens, 16, FP, ""))
    assert base.isdisjoint(hash_blocks(tokens, 16, FP + "-fp8", "tenant-a"))
    # length-prefixed fields: moving a character between fingerprint and salt changes the domain
    assert hash_blocks(tokens, 16, "ab", "c") != hash_blocks(tokens, 16, "a", "bc")


def test_packed_form_matches_and_bad_input_is_refused() -> None:
    tokens = [0, 1, 2**32 - 1, 7, 8, 9]
    assert hash_packed_blocks(pack_token_ids(tokens), 3, FP) == hash_blocks(tokens, 3, FP)
    with pytest.raises(ValueError):
        pack_token_ids([2**32])
    with pytest.raises(ValueError):
        pack_token_ids([-1])
    with pytest.raises(ValueError):
        hash_packed_blocks(b"\x00" * 5, 1, FP)
    with pytest.raises(ValueError):
        hash_blocks(tokens, 0, FP)
    with pytest.raises(ValueError):
        hash_block(b"short", [1], FP)
    with pytest.raises(ValueError):
        hash_block(None, [], FP)


def test_hex_round_trip_and_validation() -> None:
    h = hash_block(None, [1, 2, 3], FP)
    text = block_hash_hex(h)
    assert len(text) == 2 * BLOCK_HASH_NUM_BYTES and block_hash_from_hex(text) == h
    for bad in (text.upper(), text[:-1], text[:-2] + "zz", text[:-2] + " 0", "+" + text[1:]):
        with pytest.raises(ValueError):
            block_hash_from_hex(bad)
    with pytest.raises(ValueError):
        block_hash_hex(b"\x00" * 16)
