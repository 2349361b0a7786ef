"""The G3 on-disk block format: one file per KV block, a self-describing header, then the payload.

Every worker can read the shared store, so a file must prove it is the block the reader asked for
before a byte of it reaches attention: ``read_block_file`` checks the header's own checksum, the
model fingerprint, the KV layout, the dtype, the block hash, the payload length and the payload
checksum, and raises ``BlockFileError`` (with a ``BlockFileFault`` reason) on any mismatch. A caller
treats every fault as a miss and recomputes.

Layout (little-endian; ``header_len`` counts every byte before the payload):

    magic 8s | version u16 | header_len u32                                  _PREFIX
    block_hash 32s | num_layers u32 | num_kv_heads u32 | head_dim u32
    | block_size u32 | payload_len u64 | payload_checksum 16s
    | stored_at f64 | expires_at f64                                        _FIXED
    fingerprint, dtype, retention_class, kv_kind (version 3 on): each u16 length + utf-8
    header_crc u32: crc32 of every header byte before it
    payload (payload_len bytes; the caller packs tensors)

The header carries the retention class and stored/expiry times so that the kvcache index can be
rebuilt from a scan of headers alone (``read_header``); it is written once, so a later use is
recorded in the file's mtime (``touch_block_file``). Writes are atomic: a temp file in the target
directory, then ``os.replace``, so a reader sees a whole file or none. Temp names start with "." and
end with ".tmp"; a scan skips them and GC deletes stale ones (a writer that died mid-write).
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import os
import re
import secrets
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path
from typing import BinaryIO, Final

import xxhash

from libs.kvstore.block_hash import BLOCK_HASH_NUM_BYTES, block_hash_hex
from libs.kvstore.kv_spec import MHA, KVSpec

MAGIC: Final = b"DIKVBLK\x00"
FORMAT_VERSION: Final = 3  # the newest; every version in _PAYLOAD_CHECKSUMS is read
# MHA blocks are still written as version 2, which a reader from before version 3 reads too (and
# would delete as unreadable otherwise: during a rolling upgrade both share the store); only MLA
# blocks, which no older reader could use, need version 3.
MHA_FORMAT_VERSION: Final = 2
BLOCK_FILE_SUFFIX: Final = ".kvb"
TEMP_FILE_SUFFIX: Final = ".tmp"
MAX_HEADER_NUM_BYTES: Final = 4096  # a bigger header_len is corruption, not a long fingerprint
_PREFIX: Final = struct.Struct("<8sHI")
_FIXED: Final = struct.Struct(f"<{BLOCK_HASH_NUM_BYTES}sIIIIQ16sdd")
_STR_LEN: Final = struct.Struct("<H")
_CRC: Final = struct.Struct("<I")
# a fingerprint names a directory of the store: no separators, no "..", no hidden names
_FINGERPRINT: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class BlockFileFault(enum.Enum):
    MISSING = "missing"
    UNREADABLE = "unreadable"  # an I/O error other than a missing file
    TRUNCATED = "truncated"  # shorter than its header says (a torn write, a copy cut short)
    BAD_MAGIC = "bad magic"  # not a block file at all
    BAD_VERSION = "bad version"  # a block file of a format this reader does not know
    CORRUPT_HEADER = "corrupt header"  # header checksum or field encoding wrong, or trailing bytes
    CORRUPT_PAYLOAD = "corrupt payload"  # payload checksum wrong
    FOREIGN_MODEL = "foreign model"  # another model fingerprint
    WRONG_LAYOUT = "wrong layout"  # KV kind / num_layers / num_kv_heads / head_dim / block_size differ
    WRONG_DTYPE = "wrong dtype"
    WRONG_HASH = "wrong hash"  # a valid block, but not the one asked for


class BlockFileError(Exception):
    """A block file that must not be used; ``reason`` says why, ``detail`` gives the numbers."""

    def __init__(self, path: Path | str, reason: BlockFileFault, detail: str = "") -> None:
        super().__init__(f"{path}: {reason.value}" + (f" ({detail})" if detail else ""))
        self.path = Path(path)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Shape of one block's KV: the model's KV spec and the tokens per block. The payload is
    ``kv_spec.block_shape(block_size)`` packed by the caller."""

    kv_spec: KVSpec
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a writer knows about a block: identity, layout, retention. Unix times in seconds."""

    block_hash: bytes
    fingerprint: str
    layout: BlockLayout
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    retention_class: str
    stored_at: float
    expires_at: float


@dataclass(frozen=True, slots=True)
class BlockFileHeader:
    """A parsed header: the writer's meta plus what the writer derived from the payload."""

    meta: BlockMeta
    payload_len: int
    payload_checksum: bytes
    header_len: int
    version: int = FORMAT_VERSION

    @property
    def file_size(self) -> int:
        """Bytes on disk: what a store's capacity is charged for this block."""
        return self.header_len + self.payload_len


@dataclass(frozen=True, slots=True)
class Expectation:
    """What a reader needs the block to be; any difference is a fault, never a silent fallback."""

    block_hash: bytes
    fingerprint: str
    layout: BlockLayout
    dtype: str


Buffer = bytes | bytearray | memoryview


def _sha256_128(payload: Buffer) -> bytes:
    return hashlib.sha256(payload).digest()[:16]


def _xxh3_128(payload: Buffer) -> bytes:
    return xxhash.xxh3_128_digest(payload)


# Format version -> its payload checksum. 2: xxh3-128, ~50 GB/s here against sha256's ~1.6
# (hardware-accelerated), which made it the largest CPU cost of a G3 load (48 of ~150 ms for a
# 4k-token SmolLM2 prefix; 0.3 s for a Llama-3-8B one). It guards against corruption, not forgery
# (whoever can write the store can write a valid file): a damaged payload passes with probability
# ~2**-128, crc32's is 2**-32. 1: sha256's first 16 bytes, still read, so an upgrade keeps the store.
# 3: the same payload checksum; the header adds the KV kind (a version 1 or 2 block is MHA).
_PAYLOAD_CHECKSUMS: Final[dict[int, Callable[[Buffer], bytes]]] = {1: _sha256_128, 2: _xxh3_128, 3: _xxh3_128}


def _num_strings(version: int) -> int:
    return 4 if version >= 3 else 3


def payload_checksum(payload: Buffer, version: int = FORMAT_VERSION) -> bytes:
    return _PAYLOAD_CHECKSUMS[version](payload)


def block_path(root: Path | str, fingerprint: str, block_hash: bytes) -> Path:
    """``root/<fingerprint>/<ab>/<cd>/<hash hex>.kvb``: two levels of 256 directories per model
    keep each directory small (10M blocks -> ~150 files per leaf)."""
    if not _FINGERPRINT.fullmatch(fingerprint):
        raise ValueError(f"fingerprint {fingerprint!r} is not a safe directory name")
    name = block_hash_hex(block_hash)
    return Path(root) / fingerprint / name[:2] / name[2:4] / f"{name}{BLOCK_FILE_SUFFIX}"


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_FILE_SUFFIX)


def _encode_str(text: str) -> bytes:
    data = text.encode()
    return _STR_LEN.pack(len(data)) + data


def written_version(layout: BlockLayout) -> int:
    """The format a block of ``layout`` is written in: the oldest that can hold it."""
    return MHA_FORMAT_VERSION if layout.kv_spec.kind == MHA else FORMAT_VERSION


def encode_header(meta: BlockMeta, payload_len: int, checksum: bytes, version: int | None = None) -> bytes:
    """Header bytes for a payload of ``payload_len`` bytes whose ``payload_checksum`` is ``checksum``
    (``version``: by default ``written_version``; another, to test that it is still read)."""
    if version is None:
        version = written_version(meta.layout)
    if len(meta.block_hash) != BLOCK_HASH_NUM_BYTES:
        raise ValueError(f"block hash has {len(meta.block_hash)} bytes, expected {BLOCK_HASH_NUM_BYTES}")
    spec = meta.layout.kv_spec
    fixed = _FIXED.pack(
        meta.block_hash,
        spec.num_layers,
        spec.num_kv_heads,
        spec.head_dim,
        meta.layout.block_size,
        payload_len,
        checksum,
        meta.stored_at,
        meta.expires_at,
    )
    texts = [meta.fingerprint, meta.dtype, meta.retention_class, spec.kind][: _num_strings(version)]
    if version < 3 and spec.kind != MHA:
        raise ValueError(f"format version {version} holds only {MHA} blocks")
    strings = b"".join(_encode_str(s) for s in texts)
    header_len = _PREFIX.size + len(fixed) + len(strings) + _CRC.size
    if header_len > MAX_HEADER_NUM_BYTES:
        raise ValueError(f"header of {header_len} bytes exceeds {MAX_HEADER_NUM_BYTES}")
    body = _PREFIX.pack(MAGIC, version, header_len) + fixed + strings
    return body + _CRC.pack(zlib.crc32(body))


def _decode_fields(path: Path, header: bytes, version: int) -> BlockFileHeader:
    """Fields of a header whose length and crc were already checked."""
    try:
        values = _FIXED.unpack_from(header, _PREFIX.size)
        offset = _PREFIX.size + _FIXED.size
        texts: list[str] = []
        for _ in range(_num_strings(version)):
            (num_bytes,) = _STR_LEN.unpack_from(header, offset)
            offset += _STR_LEN.size
            if offset + num_bytes > len(header) - _CRC.size:
                raise ValueError("string runs past the header")
            texts.append(header[offset : offset + num_bytes].decode())
            offset += num_bytes
    except (struct.error, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise BlockFileError(path, BlockFileFault.CORRUPT_HEADER, str(e)) from None
    if offset != len(header) - _CRC.size:
        raise BlockFileError(path, BlockFileFault.CORRUPT_HEADER, "bytes after the last field")
    block_hash, num_layers, num_kv_heads, head_dim, block_size, payload_len, checksum = values[:7]
    kind = texts[3] if version >= 3 else MHA
    try:
        spec = KVSpec(kind, num_layers, num_kv_heads, head_dim)
    except ValueError as e:
        raise BlockFileError(path, BlockFileFault.CORRUPT_HEADER, str(e)) from None
    meta = BlockMeta(
        block_hash=block_hash,
        fingerprint=texts[0],
        layout=BlockLayout(spec, block_size),
        dtype=texts[1],
        retention_class=texts[2],
        stored_at=values[7],
        expires_at=values[8],
    )
    return BlockFileHeader(meta, payload_len, checksum, len(header), version)


def _read_header_from(f: BinaryIO, path: Path) -> BlockFileHeader:
    prefix = f.read(_PREFIX.size)
    if len(prefix) < _PREFIX.size:
        raise BlockFileError(path, BlockFileFault.TRUNCATED, f"{len(prefix)} bytes, no header")
    magic, version, header_len = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise BlockFileError(path, BlockFileFault.BAD_MAGIC, repr(magic))
    if version not in _PAYLOAD_CHECKSUMS:
        raise BlockFileError(path, BlockFileFault.BAD_VERSION, f"version {version}")
    min_len = _PREFIX.size + _FIXED.size + _num_strings(version) * _STR_LEN.size + _CRC.size
    if not min_len <= header_len <= MAX_HEADER_NUM_BYTES:
        raise BlockFileError(path, BlockFileFault.CORRUPT_HEADER, f"header_len {header_len}")
    rest = f.read(header_len - _PREFIX.size)
    if len(rest) < header_len - _PREFIX.size:
        raise BlockFileError(path, BlockFileFault.TRUNCATED, f"header cut at {_PREFIX.size + len(rest)}")
    header = prefix + rest
    (crc,) = _CRC.unpack_from(header, header_len - _CRC.size)
    if crc != zlib.crc32(memoryview(header)[: header_len - _CRC.size]):
        raise BlockFileError(path, BlockFileFault.CORRUPT_HEADER, "header checksum")
    parsed = _decode_fields(path, header, version)
    file_size = os.fstat(f.fileno()).st_size
    if file_size < parsed.file_size:
        raise BlockFileError(path, BlockFileFault.TRUNCATED, f"{file_size} of {parsed.file_size} bytes")
    if file_size > parsed.file_size:
        extra = file_size - parsed.file_size
        raise BlockFileError(path, BlockFileFault.CORRUPT_HEADER, f"{extra} bytes after the payload")
    return parsed


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[BufferedReader]:
    """``path`` open for reading; an I/O error (EIO on a network mount, a directory, no permission)
    becomes a fault too, so a reader has one exception to turn into a recompute."""
    try:
        with open(path, "rb") as f:
            yield f
    except FileNotFoundError:
        raise BlockFileError(path, BlockFileFault.MISSING) from None
    except OSError as e:
        raise BlockFileError(path, BlockFileFault.UNREADABLE, str(e)) from None


def read_header(path: Path | str) -> BlockFileHeader:
    """The header of a block file, checked (magic, version, crc, file size) but without reading the
    payload: what a scan of the store needs to rebuild the index."""
    path = Path(path)
    with _reading(path) as f:
        return _read_header_from(f, path)


def _check_expected(path: Path, meta: BlockMeta, expect: Expectation) -> None:
    if meta.fingerprint != expect.fingerprint:
        raise BlockFileError(path, BlockFileFault.FOREIGN_MODEL, f"{meta.fingerprint!r}")
    if meta.layout != expect.layout:
        raise BlockFileError(path, BlockFileFault.WRONG_LAYOUT, f"{meta.layout} != {expect.layout}")
    if meta.dtype != expect.dtype:
        raise BlockFileError(path, BlockFileFault.WRONG_DTYPE, f"{meta.dtype!r} != {expect.dtype!r}")
    if meta.block_hash != expect.block_hash:
        raise BlockFileError(path, BlockFileFault.WRONG_HASH, block_hash_hex(meta.block_hash))


def read_block_file(path: Path | str, expect: Expectation) -> bytearray:
    """The payload of the block file at ``path``, only if it is exactly the block ``expect`` names
    and intact; ``BlockFileError`` otherwise. A corrupt block is never returned. Read straight into
    a writable buffer, which torch.frombuffer can share: no copy after the read."""
    path = Path(path)
    with _reading(path) as f:
        header = _read_header_from(f, path)
        _check_expected(path, header.meta, expect)
        payload = bytearray(header.payload_len)
        num_read = f.readinto(payload)
    if num_read != header.payload_len:  # the file shrank after the size check
        detail = f"payload {num_read} of {header.payload_len} bytes"
        raise BlockFileError(path, BlockFileFault.TRUNCATED, detail)
    if payload_checksum(payload, header.version) != header.payload_checksum:
        raise BlockFileError(path, BlockFileFault.CORRUPT_PAYLOAD, "payload checksum")
    return payload


def touch_block_file(path: Path | str, now: float) -> None:
    """Record a use in the file's mtime, which a rebuild of the index reads as the block's last use
    (the header's times are written once). Cheap: one metadata update, no data."""
    os.utime(path, (now, now))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_block_file(
    path: Path | str, meta: BlockMeta, payload: bytes | memoryview, *, fsync: bool = False
) -> BlockFileHeader:
    """Write one block file atomically (temp file in the same directory, then ``os.replace``).

    ``fsync`` also flushes the file and its directory, for a store that must survive a power loss
    rather than only a process death. Returns the header written; ``file_size`` is what it costs.
    """
    path = Path(path)
    view = memoryview(payload).cast("B")
    version = written_version(meta.layout)
    checksum = payload_checksum(view, version)
    header_bytes = encode_header(meta, len(view), checksum, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{secrets.token_hex(6)}{TEMP_FILE_SUFFIX}")
    try:
        with open(temp, "xb") as f:
            f.write(header_bytes)
            f.write(view)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(path.parent)
    return BlockFileHeader(meta, len(view), checksum, len(header_bytes), version)
