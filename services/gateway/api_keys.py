"""API keys: who may call the gateway, as which tenant, at what rate and priority. Pure.

The keys file (``--api-keys-file``) holds each key's SHA-256, never the key itself, so a leaked
file admits nobody::

    {"keys": [
      {"sha256": "<64 hex digits>", "tenant": "acme", "requests_per_minute": 600, "priority": 0,
       "weight": 2, "name": "acme-ci"}
    ]}

``tenant`` (required): whose KV cache the key's requests use and whose usage they count as; keys
of one tenant share both. ``requests_per_minute`` (0 or absent: no limit): a token bucket per key
that holds a minute's requests and refills continuously, as OpenAI's request limits behave.
``priority`` (default 0, lower runs first): the scheduler's order between waiting requests.
``weight`` (default 1): the tenant's share when tenants wait together (the scheduler's fair queue
admits a tenant of weight 2 twice as often as one of weight 1; give a tenant's keys one weight).
``name``: how logs name the key (default: the first 8 hex digits of its hash).
``deepinfer api-key`` mints a key and appends its entry; the gateway reloads the file on SIGHUP.

A key is looked up by its hash: the presented key is hashed once per request, and a dict lookup
of that hash tells nothing about other keys' hashes (the minted keys carry 256 random bits, so a
plain unsalted SHA-256 is enough; ``printf %s "$KEY" | sha256sum`` makes an entry by hand).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

KEY_PREFIX: Final = "sk-di-"  # minted keys: recognizable in logs and by secret scanners
MAX_TENANT_CHARS: Final = 128
MAX_REQUESTS_PER_MINUTE: Final = 10**9
_HEX64: Final = re.compile(r"[0-9a-f]{64}")
_FIELDS: Final = frozenset({"sha256", "tenant", "requests_per_minute", "priority", "weight", "name"})
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e6  # a tiny weight would make one admission cost the queue infinity


def hash_key(api_key: str) -> str:
    """A key's entry in the keys file: its SHA-256, hex."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_key() -> str:
    """A fresh key: the prefix and 256 random bits."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_hash: str  # SHA-256 of the key, 64 lowercase hex digits
    tenant: str
    requests_per_minute: int = 0  # 0: no limit
    priority: int = 0  # lower runs first
    name: str = ""
    weight: float = 1.0  # the tenant's share of admissions (services/scheduler/fair_queue.py)

    @property
    def label(self) -> str:
        """How logs and errors name the key (never the key, never its whole hash)."""
        return self.name or self.key_hash[:8]

    def entry(self) -> dict[str, Any]:
        """The key's entry in the keys file."""
        out: dict[str, Any] = {"sha256": self.key_hash, "tenant": self.tenant}
        if self.requests_per_minute:
            out["requests_per_minute"] = self.requests_per_minute
        if self.priority:
            out["priority"] = self.priority
        if self.weight != 1.0:
            out["weight"] = self.weight
        if self.name:
            out["name"] = self.name
        return out


def _int_field(entry: Mapping[str, Any], key: str, lo: int, hi: int, where: str) -> int:
    value = entry.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{where}: '{key}' must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _printable(value: Any, key: str, where: str, required: bool) -> str:
    if value is None and not required:
        return ""
    text = value if isinstance(value, str) and value.isascii() and value.isprintable() else ""
    if not 0 < len(text) <= MAX_TENANT_CHARS:
        raise ValueError(f"{where}: '{key}' must be 1 to {MAX_TENANT_CHARS} printable ASCII characters")
    return text


def _weight(entry: Mapping[str, Any], where: str) -> float:
    value = entry.get("weight", 1.0)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and MIN_WEIGHT <= value <= MAX_WEIGHT
    if not ok:
        bounds = f"[{MIN_WEIGHT:g}, {MAX_WEIGHT:g}]"
        raise ValueError(f"{where}: 'weight' must be a number in {bounds}, got {value!r}")
    return float(value)


def parse_entry(entry: Any, where: str) -> ApiKey:
    """One entry of the keys file (ValueError naming ``where`` and the field at fault)."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: an entry must be an object")
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        known = ", ".join(sorted(_FIELDS))
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)} (known: {known})")
    key_hash = entry.get("sha256")
    if not isinstance(key_hash, str) or not _HEX64.fullmatch(key_hash.lower()):
        raise ValueError(f"{where}: 'sha256' must be the key's SHA-256 as 64 hex digits (not the key)")
    return ApiKey(
        key_hash=key_hash.lower(),
        tenant=_printable(entry.get("tenant"), "tenant", where, required=True),
        requests_per_minute=_int_field(entry, "requests_per_minute", 0, MAX_REQUESTS_PER_MINUTE, where),
        priority=_int_field(entry, "priority", -(2**31), 2**31 - 1, where),
        name=_printable(entry.get("name"), "name", where, required=False),
        weight=_weight(entry, where),
    )


def parse_keys(text: str, source: str = "keys file") -> tuple[ApiKey, ...]:
    """Every key of a keys file's text; ValueError on anything malformed (a file that admits
    nobody by mistake must not replace one that works). No key is allowed: nobody gets in."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{source}: not JSON: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list) or set(doc) != {"keys"}:
        raise ValueError(f'{source}: must be an object {{"keys": [...]}}')
    keys = tuple(parse_entry(entry, f"{source}, key {i}") for i, entry in enumerate(doc["keys"]))
    seen: set[str] = set()
    weights: dict[str, float] = {}
    for i, key in enumerate(keys):
        if key.key_hash in seen:
            raise ValueError(f"{source}, key {i}: the same key hash appears twice")
        seen.add(key.key_hash)
        # the weight is the tenant's share: one per tenant, whichever of its keys a request uses
        if weights.setdefault(key.tenant, key.weight) != key.weight:
            raise ValueError(f"{source}, key {i}: tenant {key.tenant!r} has keys of different weights")
    return keys


def read_keys_file(path: str) -> tuple[ApiKey, ...]:
    """The keys of the file at ``path`` (ValueError if it cannot be read or is malformed)."""
    source = f"api_keys_file {path}"
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"{source}: {exc.strerror or exc}") from exc
    return parse_keys(text, source)


def dump_keys(keys: Iterable[ApiKey]) -> str:
    """A keys file's text (what ``parse_keys`` reads back)."""
    return json.dumps({"keys": [key.entry() for key in keys]}, indent=2) + "\n"


@dataclass(slots=True)
class TokenBucket:
    """``capacity`` requests, refilled at ``capacity`` per minute; times in seconds."""

    capacity: int
    tokens: float
    updated: float

    def refill(self, now: float) -> None:
        rate = self.capacity / 60.0
        self.tokens = min(float(self.capacity), self.tokens + max(0.0, now - self.updated) * rate)
        self.updated = max(self.updated, now)

    def until_next(self) -> float:
        """Seconds until a whole request is available (0: now)."""
        return max(0.0, (1.0 - self.tokens) * 60.0 / self.capacity)

    def until_full(self) -> float:
        return max(0.0, (self.capacity - self.tokens) * 60.0 / self.capacity)


@dataclass(frozen=True, slots=True)
class Allowed:
    key: ApiKey
    limit: int  # requests per minute (0: none)
    remaining: int  # requests the key could still send at once
    reset_s: float  # seconds until its bucket is full again


@dataclass(frozen=True, slots=True)
class Limited:
    key: ApiKey
    limit: int
    retry_after_s: float  # seconds until one more request is allowed
    reset_s: float


Decision = Allowed | Limited | None  # None: no such key


@dataclass(slots=True)
class KeyTable:
    """The keys in force and each limited key's bucket. ``check`` is one request's admission."""

    keys: dict[str, ApiKey] = field(default_factory=dict)  # hash -> key
    buckets: dict[str, TokenBucket] = field(default_factory=dict)  # hash -> bucket (limited keys)

    @classmethod
    def of(cls, keys: Iterable[ApiKey], now: float) -> KeyTable:
        table = cls()
        table.replace(keys, now)
        return table

    def replace(self, keys: Iterable[ApiKey], now: float) -> None:
        """Put ``keys`` in force (a reload). A key that stays, with the same limit, keeps its
        bucket: a reload must not hand every client a fresh minute of requests."""
        new = {key.key_hash: key for key in keys}
        buckets: dict[str, TokenBucket] = {}
        for key_hash, key in new.items():
            if not key.requests_per_minute:
                continue
            old, kept = self.keys.get(key_hash), self.buckets.get(key_hash)
            if old is not None and kept is not None and old.requests_per_minute == key.requests_per_minute:
                buckets[key_hash] = kept
            else:
                buckets[key_hash] = TokenBucket(key.requests_per_minute, float(key.requests_per_minute), now)
        self.keys, self.buckets = new, buckets
        self.check_integrity()

    def check(self, presented: str, now: float) -> Decision:
        """Admit one request presenting ``presented`` ("" when it sent none) at ``now``."""
        key = self.keys.get(hash_key(presented)) if presented else None
        if key is None:
            return None
        bucket = self.buckets.get(key.key_hash)
        if bucket is None:
            return Allowed(key, 0, 0, 0.0)
        bucket.refill(now)
        if bucket.tokens < 1.0:
            return Limited(key, bucket.capacity, bucket.until_next(), bucket.until_full())
        bucket.tokens -= 1.0
        return Allowed(key, bucket.capacity, math.floor(bucket.tokens), bucket.until_full())

    def check_integrity(self) -> None:
        assert set(self.buckets) == {h for h, k in self.keys.items() if k.requests_per_minute}
        for key_hash, bucket in self.buckets.items():
            assert bucket.capacity == self.keys[key_hash].requests_per_minute > 0
            assert 0.0 <= bucket.tokens <= bucket.capacity
