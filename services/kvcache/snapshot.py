"""The block index's snapshot: its G3 entries in one file in the store root, so a restart keeps
every block's recency (last use, expiry, class) without trusting file mtimes alone.

A snapshot is a cache of the index, never the truth (the store is). A missing, damaged, old-format
or foreign (written for another root) snapshot raises ``SnapshotError`` and the service rebuilds
the index by scanning the store; a valid one is still reconciled with the store right after
loading, since blocks were stored and deleted after it was written.

Blocking file I/O, no asyncio: the service runs these in a worker thread. Layout (little-endian):

    magic 8s | version u16 | body_checksum 16s                  _PREFIX
    body: msgpack [root, saved_at, entries]
          entry = [block_hash, fingerprint, size_bytes, retention_class, last_use, expires_at]

An entry's location is not stored: it is ``block_path(root, fingerprint, block_hash)``. Writes are
atomic (a temp file in the root, then ``os.replace``), so a reader sees a whole snapshot or the one
before it. The file and its temps start with "." so a store scan reports them as not-blocks and
never deletes them; ``remove_stale_temps`` clears the temps of a writer that died.
"""

from __future__ import annotations

import enum
import hashlib
import os
import struct
from pathlib import Path
from typing import Any, Final

import msgpack

from libs.kvstore.atomic_write import write_atomic
from libs.kvstore.block_file import block_path
from libs.kvstore.block_hash import BLOCK_HASH_NUM_BYTES
from libs.kvstore.retention import RetentionPolicy
from services.kvcache.index import BlockEntry, BlockIndex, Placement, Tier

MAGIC: Final = b"DIKVIDX\x00"
FORMAT_VERSION: Final = 1
SNAPSHOT_NAME: Final = ".kvcache-index"
_TEMP_SUFFIX: Final = ".tmp"
_PREFIX: Final = struct.Struct("<8sH16s")


class SnapshotFault(enum.Enum):
    MISSING = "missing"
    UNREADABLE = "unreadable"  # an I/O error other than a missing file
    CORRUPT = "corrupt"  # bad magic, checksum or field
    BAD_VERSION = "bad version"  # a format this reader does not know
    OTHER_ROOT = "other root"  # written for another store directory


class SnapshotError(Exception):
    """A snapshot that must not be loaded; ``reason`` says why."""

    def __init__(self, path: Path, reason: SnapshotFault, detail: str = "") -> None:
        super().__init__(f"{path}: {reason.value}" + (f" ({detail})" if detail else ""))
        self.path = path
        self.reason = reason


def snapshot_path(root: Path | str) -> Path:
    return Path(root) / SNAPSHOT_NAME


def _checksum(body: bytes | memoryview) -> bytes:
    return hashlib.sha256(body).digest()[:16]


def _root_id(root: Path | str) -> str:
    return os.path.abspath(root)


def _row(e: BlockEntry) -> list[Any]:
    placement = e.placement
    return [
        e.block_hash,
        placement.fingerprint,
        placement.size_bytes,
        e.retention_class,
        e.last_use,
        e.expires_at,
    ]


def encode_snapshot(index: BlockIndex, root: Path | str, saved_at: float) -> bytes:
    entries = [_row(e) for e in index.entries(Tier.G3)]
    body: bytes = msgpack.packb([_root_id(root), saved_at, entries], use_bin_type=True)
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, _checksum(body)) + body


def _entry(root: Path, policy: RetentionPolicy, item: list[Any]) -> BlockEntry:
    """One stored entry, type-checked (a checksum passes what a buggy writer wrote)."""
    block_hash, fingerprint, size_bytes, cls_name, last_use, expires_at = item
    if not (isinstance(block_hash, bytes) and len(block_hash) == BLOCK_HASH_NUM_BYTES):
        raise ValueError("bad block hash")
    if not (isinstance(fingerprint, str) and isinstance(size_bytes, int) and isinstance(cls_name, str)):
        raise ValueError("bad field type")
    if not (isinstance(last_use, int | float) and isinstance(expires_at, int | float)):
        raise ValueError("bad time")
    # A class the policy no longer defines becomes the default, as in a rebuild from the store.
    cls = policy.classes.get(cls_name, policy.default)
    location = str(block_path(root, fingerprint, block_hash))
    placement = Placement(Tier.G3, location, size_bytes, fingerprint)
    return BlockEntry(block_hash, placement, cls.name, float(last_use), float(expires_at))


def decode_snapshot(data: bytes, root: Path | str, policy: RetentionPolicy) -> BlockIndex:
    """The index ``data`` (a snapshot's bytes) holds, for the store at ``root``."""
    path = snapshot_path(root)
    if len(data) < _PREFIX.size:
        raise SnapshotError(path, SnapshotFault.CORRUPT, f"{len(data)} bytes, no header")
    magic, version, checksum = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotError(path, SnapshotFault.CORRUPT, f"magic {magic!r}")
    if version != FORMAT_VERSION:
        raise SnapshotError(path, SnapshotFault.BAD_VERSION, f"version {version}")
    body = memoryview(data)[_PREFIX.size :]
    if _checksum(body) != checksum:
        raise SnapshotError(path, SnapshotFault.CORRUPT, "checksum")
    index = BlockIndex(policy)
    try:
        snap_root, _saved_at, items = msgpack.unpackb(body, raw=False)
        if snap_root != _root_id(root):
            raise SnapshotError(path, SnapshotFault.OTHER_ROOT, f"written for {snap_root!r}")
        for item in items:
            e = _entry(Path(root), policy, item)
            index.insert(e.block_hash, e.placement, e.last_use, e.retention_class, expires_at=e.expires_at)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise SnapshotError(path, SnapshotFault.CORRUPT, str(exc)) from None
    return index


def load_snapshot(root: Path | str, policy: RetentionPolicy) -> BlockIndex:
    """The index saved for the store at ``root``; ``SnapshotError`` if there is no usable one."""
    path = snapshot_path(root)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SnapshotError(path, SnapshotFault.MISSING) from None
    except OSError as exc:
        raise SnapshotError(path, SnapshotFault.UNREADABLE, str(exc)) from None
    return decode_snapshot(data, root, policy)


def write_snapshot(index: BlockIndex, root: Path | str, saved_at: float) -> int:
    """Save the G3 entries of ``index`` for the store at ``root``, atomically; returns the bytes
    written. Nothing else may change ``index`` meanwhile."""
    path = snapshot_path(root)
    data = encode_snapshot(index, root, saved_at)
    write_atomic(path, data, temp_prefix=SNAPSHOT_NAME)  # a name remove_stale_temps finds
    return len(data)


def remove_stale_temps(root: Path | str) -> list[Path]:
    """Delete snapshot temp files a dead writer left (call before this process writes any)."""
    removed: list[Path] = []
    for temp in Path(root).glob(f"{SNAPSHOT_NAME}.*{_TEMP_SUFFIX}"):
        temp.unlink(missing_ok=True)
        removed.append(temp)
    return removed
