"""API keys: the keys file's checks, lookup by hash, each key's token bucket (limit, refill,
reset), and a reload that keeps the buckets of the keys it keeps."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from services.gateway.api_keys import (
    KEY_PREFIX,
    Allowed,
    ApiKey,
    KeyTable,
    Limited,
    dump_keys,
    hash_key,
    new_key,
    parse_keys,
)

A, B = "sk-di-alpha", "sk-di-beta"


def entry(key: str, tenant: str = "acme", **more: Any) -> dict[str, Any]:
    return {"sha256": hash_key(key), "tenant": tenant, **more}


def doc(*entries: dict[str, Any]) -> str:
    return json.dumps({"keys": list(entries)})


def test_a_key_is_stored_as_its_sha256_and_read_back() -> None:
    assert hash_key(A) == hashlib.sha256(A.encode()).hexdigest()  # `printf %s KEY | sha256sum`
    keys = parse_keys(
        doc(entry(A, requests_per_minute=60, priority=-2, name="ci", weight=2.5), entry(B, "beta"))
    )
    assert keys == (
        ApiKey(hash_key(A), "acme", 60, -2, "ci", 2.5),
        ApiKey(hash_key(B), "beta"),
    )
    assert parse_keys(dump_keys(keys)) == keys
    assert A not in dump_keys(keys)
    assert keys[0].label == "ci" and keys[1].label == hash_key(B)[:8]
    # an upper-case hash (some tools print one) is the same key
    assert parse_keys(doc({**entry(A), "sha256": hash_key(A).upper()}))[0].key_hash == hash_key(A)


def test_minted_keys_are_distinct_and_prefixed() -> None:
    keys = {new_key() for _ in range(100)}
    assert len(keys) == 100 and all(k.startswith(KEY_PREFIX) and len(k) > 40 for k in keys)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("not json", "not JSON"),
        ("[]", '{"keys"'),
        ('{"keys": [], "extra": 1}', '{"keys"'),
        (doc({"sha256": A, "tenant": "acme"}), "64 hex digits (not the key)"),  # the key itself
        (doc({"tenant": "acme"}), "'sha256'"),
        (doc(entry(A, tenant="")), "'tenant'"),
        (doc({"sha256": hash_key(A)}), "'tenant'"),
        (doc(entry(A, tenant="a\nb")), "'tenant'"),
        (doc(entry(A, tenant="x" * 129)), "'tenant'"),
        (doc(entry(A, requests_per_minute=-1)), "'requests_per_minute'"),
        (doc(entry(A, requests_per_minute=1.5)), "'requests_per_minute'"),
        (doc(entry(A, requests_per_minute=True)), "'requests_per_minute'"),
        (doc(entry(A, priority="high")), "'priority'"),
        (doc(entry(A, rpm=5)), "unknown field(s) rpm"),
        (doc(entry(A, weight=0)), "'weight'"),
        (doc(entry(A, weight=1e-320)), "'weight'"),
        (doc(entry(A, weight=2.0), entry(B, weight=3.0)), "different weights"),
        (doc(entry(A, weight=-1.5)), "'weight'"),
        (doc(entry(A, weight="2")), "'weight'"),
        (doc(entry(A, weight=True)), "'weight'"),
        (doc(entry(A), entry(A, "other")), "twice"),
        (json.dumps({"keys": ["sk"]}), "must be an object"),
    ],
)
def test_a_malformed_file_is_refused_naming_what(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="keys file") as exc:
        parse_keys(text)
    assert says in str(exc.value)


def test_no_keys_admits_nobody() -> None:
    table = KeyTable.of(parse_keys(doc()), now=0.0)
    assert table.check(A, 0.0) is None and table.check("", 0.0) is None


def test_lookup_is_by_the_whole_key() -> None:
    table = KeyTable.of(parse_keys(doc(entry(A), entry(B, "beta", priority=3))), now=0.0)
    allowed = table.check(B, 0.0)
    assert isinstance(allowed, Allowed) and allowed.key.tenant == "beta" and allowed.key.priority == 3
    assert allowed.limit == 0  # no limit: no rate-limit numbers
    for wrong in ("", A[:-1], A + " ", A.upper(), hash_key(A)):
        assert table.check(wrong, 0.0) is None
    table.check_integrity()


def test_a_limited_key_gets_a_minute_of_requests_then_waits() -> None:
    table = KeyTable.of([ApiKey(hash_key(A), "acme", requests_per_minute=3)], now=100.0)
    remaining = []
    for _ in range(3):
        decision = table.check(A, 100.0)
        assert isinstance(decision, Allowed) and decision.limit == 3
        remaining.append(decision.remaining)
        table.check_integrity()
    assert remaining == [2, 1, 0]
    limited = table.check(A, 100.0)
    assert isinstance(limited, Limited)
    assert limited.retry_after_s == pytest.approx(20.0)  # 3 a minute: one every 20 s
    assert limited.reset_s == pytest.approx(60.0)
    table.check_integrity()
    # 10 s later: still half a request short; 20 s: one more, and the bucket is empty again
    later = table.check(A, 110.0)
    assert isinstance(later, Limited) and later.retry_after_s == pytest.approx(10.0)
    assert isinstance(table.check(A, 120.0), Allowed)
    assert isinstance(table.check(A, 120.0), Limited)
    # a long pause fills the bucket to its size, no more
    for _ in range(3):
        assert isinstance(table.check(A, 10_000.0), Allowed)
    assert isinstance(table.check(A, 10_000.0), Limited)
    table.check_integrity()


def test_a_clock_going_back_gives_nothing() -> None:
    table = KeyTable.of([ApiKey(hash_key(A), "acme", requests_per_minute=1)], now=50.0)
    assert isinstance(table.check(A, 50.0), Allowed)
    assert isinstance(table.check(A, 10.0), Limited)
    assert isinstance(table.check(A, 50.0), Limited)
    table.check_integrity()


def test_each_key_has_its_own_bucket() -> None:
    table = KeyTable.of(
        [ApiKey(hash_key(A), "acme", requests_per_minute=1), ApiKey(hash_key(B), "acme", 1)], now=0.0
    )
    assert isinstance(table.check(A, 0.0), Allowed)
    assert isinstance(table.check(A, 0.0), Limited)
    assert isinstance(table.check(B, 0.0), Allowed)


def test_a_reload_keeps_the_buckets_of_the_keys_it_keeps() -> None:
    table = KeyTable.of(
        [ApiKey(hash_key(A), "acme", requests_per_minute=2), ApiKey(hash_key(B), "beta", 2)], now=0.0
    )
    for _ in range(2):
        table.check(A, 0.0)
    # A stays with the same limit (its bucket is still empty), B's limit changes (a fresh bucket),
    # C is new, and a key dropped from the file is refused.
    c = "sk-di-gamma"
    table.replace(
        [ApiKey(hash_key(A), "acme2", 2), ApiKey(hash_key(B), "beta", 5), ApiKey(hash_key(c), "g")], now=0.0
    )
    table.check_integrity()
    limited = table.check(A, 0.0)
    assert isinstance(limited, Limited) and limited.key.tenant == "acme2"
    fresh = table.check(B, 0.0)
    assert isinstance(fresh, Allowed) and fresh.remaining == 4
    assert isinstance(table.check(c, 0.0), Allowed)
    table.replace([ApiKey(hash_key(c), "g")], now=0.0)
    table.check_integrity()
    assert table.check(A, 0.0) is None and table.check(B, 0.0) is None
    assert not table.buckets
