"""Chained hashes of full KV blocks: the one key that G1 pages, G2 host memory and G3 files share.

A block's hash commits to everything that determines its KV content: the hash of the block before
it (and so, transitively, every token before it), its own ``block_size`` token ids, the model
fingerprint (weights, dtype, KV layout: whatever the caller folds into it) and the tenant salt.

    h[0] = blake2b-256(domain(fingerprint, salt) || 0x00         || tokens[0 : B])
    h[i] = blake2b-256(domain(fingerprint, salt) || 0x01 || h[i-1] || tokens[i*B : (i+1)*B]
                       [|| 0x02 || offset || length || content hash, per content span it touches])

``domain`` is length-prefixed, so no two (fingerprint, salt) pairs share a byte string, and the
whole chain of one tenant is disjoint from another's: with different salts no block hash is ever
equal, so tenants neither share KV nor can probe whether the other cached a prompt (without the salt
a hash cannot be computed; blake2b has no length extension). Tokens are packed uint32 little-endian,
the wire form of token ids (DESIGN.md), so a scheduler can hash the packed bytes it receives.

A content span is a run of tokens whose ids do not say what they hold: an image's placeholder
tokens are the same id for every image. Each block a span touches also commits to the span's
content hash, its offset from the block's start (int64) and its length (uint32), so two different
images behind the same placeholder tokens never share a block, while the blocks before the first
image (text alone) hash exactly as they would without it.

256 bits: a deliberate collision (one prompt's KV served for another) stays out of reach even for
chains that share an empty salt, and a wrong KV block must never reach attention. Only full blocks
have a hash; a partial last block is still being written and is never shared or stored.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from collections.abc import Sequence
from typing import Final, Protocol

BLOCK_HASH_NUM_BYTES: Final = 32
_DOMAIN_TAG: Final = b"deepinfer.kv.v1"  # personalisation: a format change gets a new tag
_ROOT: Final = b"\x00"  # first block of a chain: no parent
_CHILD: Final = b"\x01"  # followed by the parent's hash
_CONTENT: Final = b"\x02"  # a content span the block touches (after its tokens)
_TOKEN_NUM_BYTES: Final = 4
_HEX: Final = re.compile(r"[0-9a-f]+")  # lowercase only: one spelling per hash, one file name


class ContentSpan(Protocol):
    """Positions [offset, offset + length) of a chain hold content named by ``mm_hash``."""

    @property
    def mm_hash(self) -> bytes: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...


def _span_keys(
    spans: Sequence[ContentSpan], block_size: int, first_position: int, num_blocks: int
) -> list[bytes] | None:
    """Per block (from the one at ``first_position``), the bytes its content spans add."""
    if not spans:
        return None
    keys = [b""] * num_blocks
    for span in spans:
        first = max(0, (span.offset - first_position) // block_size)
        last = min(num_blocks, (span.offset + span.length - first_position + block_size - 1) // block_size)
        for j in range(first, last):
            start = first_position + j * block_size
            keys[j] += _CONTENT + struct.pack("<qI", span.offset - start, span.length) + span.mm_hash
    return keys


@functools.lru_cache(maxsize=256)
def _domain_hasher(fingerprint: str, salt: str) -> hashlib.blake2b:
    """A hasher already fed with the domain; callers must ``copy()`` it, never update it."""
    h = hashlib.blake2b(digest_size=BLOCK_HASH_NUM_BYTES, person=_DOMAIN_TAG)
    for text in (fingerprint, salt):
        field = text.encode()
        h.update(len(field).to_bytes(4, "little"))
        h.update(field)
    return h


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as uint32 little-endian bytes; ``ValueError`` for an id outside [0, 2**32)."""
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be in [0, 2**32): {e}") from None


def _check_parent(parent: bytes | None) -> None:
    if parent is not None and len(parent) != BLOCK_HASH_NUM_BYTES:
        raise ValueError(f"parent hash has {len(parent)} bytes, expected {BLOCK_HASH_NUM_BYTES}")


def _chain(
    base: hashlib.blake2b,
    parent: bytes | None,
    packed: memoryview,
    block_num_bytes: int,
    span_keys: list[bytes] | None = None,
) -> list[bytes]:
    hashes: list[bytes] = []
    for j, start in enumerate(range(0, len(packed) - block_num_bytes + 1, block_num_bytes)):
        h = base.copy()
        if parent is None:
            h.update(_ROOT)
        else:
            h.update(_CHILD)
            h.update(parent)
        h.update(packed[start : start + block_num_bytes])
        if span_keys is not None:
            h.update(span_keys[j])
        parent = h.digest()
        hashes.append(parent)
    return hashes


def hash_block(parent: bytes | None, token_ids: Sequence[int], fingerprint: str, salt: str = "") -> bytes:
    """The hash of one full block whose predecessor hashed to ``parent`` (None: first block)."""
    _check_parent(parent)
    if not token_ids:
        raise ValueError("a block holds at least one token")
    packed = memoryview(pack_token_ids(token_ids))
    return _chain(_domain_hasher(fingerprint, salt), parent, packed, len(packed))[0]


def hash_packed_blocks(
    packed_token_ids: bytes | memoryview,
    block_size: int,
    fingerprint: str,
    salt: str = "",
    parent: bytes | None = None,
    spans: Sequence[ContentSpan] = (),
    first_position: int = 0,
) -> list[bytes]:
    """``hash_blocks`` over token ids already packed as uint32 little-endian (the wire form)."""
    if block_size <= 0:
        raise ValueError(f"block_size={block_size} must be > 0")
    _check_parent(parent)
    packed = memoryview(packed_token_ids).cast("B")
    if len(packed) % _TOKEN_NUM_BYTES:
        raise ValueError(f"packed token ids have {len(packed)} bytes, not a multiple of 4")
    num_blocks = len(packed) // (block_size * _TOKEN_NUM_BYTES)
    keys = _span_keys(spans, block_size, first_position, num_blocks)
    return _chain(_domain_hasher(fingerprint, salt), parent, packed, block_size * _TOKEN_NUM_BYTES, keys)


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    fingerprint: str,
    salt: str = "",
    parent: bytes | None = None,
    spans: Sequence[ContentSpan] = (),
    first_position: int = 0,
) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids``, chained from ``parent`` (None: a new chain).

    ``len(token_ids) // block_size`` hashes; the tokens of a partial last block are ignored. Pass
    the last hash as ``parent`` to continue a chain over later tokens, and the chain position of
    ``token_ids[0]`` as ``first_position`` when ``spans`` (positions in the whole chain) apply.
    """
    num_full = len(token_ids) // block_size if block_size > 0 else 0
    packed = pack_token_ids(token_ids[: num_full * block_size])
    return hash_packed_blocks(packed, block_size, fingerprint, salt, parent, spans, first_position)


def block_hash_hex(block_hash: bytes) -> str:
    """The hash as lowercase hex: the file name of its G3 block, the form logs print."""
    if len(block_hash) != BLOCK_HASH_NUM_BYTES:
        raise ValueError(f"block hash has {len(block_hash)} bytes, expected {BLOCK_HASH_NUM_BYTES}")
    return block_hash.hex()


def block_hash_from_hex(text: str) -> bytes:
    """Inverse of ``block_hash_hex``; ``ValueError`` for anything that is not such a hash."""
    if len(text) != 2 * BLOCK_HASH_NUM_BYTES or not _HEX.fullmatch(text):
        raise ValueError(f"not a block hash: {text!r}")
    return bytes.fromhex(text)
