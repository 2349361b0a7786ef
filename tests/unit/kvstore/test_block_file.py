from __future__ import annotations

import hashlib
import os
import struct
import zlib
from dataclasses import replace
from pathlib import Path

import pytest

from libs.kvstore.block_file import (
    FORMAT_VERSION,
    MAGIC,
    BlockFileError,
    BlockFileFault,
    BlockLayout,
    BlockMeta,
    Expectation,
    block_path,
    encode_header,
    payload_checksum,
    read_block_file,
    read_header,
    touch_block_file,
    write_block_file,
)
from libs.kvstore.block_hash import block_hash_hex, hash_block
from libs.kvstore.kv_spec import KVSpec

FP = "smollm2-135m-q4_1"
LAYOUT = BlockLayout(KVSpec.mha(30, 3, 64), 16)
HASH = hash_block(None, list(range(16)), FP)
PAYLOAD = bytes(range(256)) * 40
META = BlockMeta(HASH, FP, LAYOUT, "bfloat16", "chat", stored_at=1_000.0, expires_at=1_000.0 + 7 * 86_400)
EXPECT = Expectation(HASH, FP, LAYOUT, "bfloat16")


def written(tmp_path: Path) -> Path:
    path = block_path(tmp_path, FP, HASH)
    write_block_file(path, META, PAYLOAD)
    return path


def fault_of(path: Path, expect: Expectation = EXPECT) -> BlockFileFault:
    with pytest.raises(BlockFileError) as info:
        read_block_file(path, expect)
    return info.value.reason


def test_round_trip_and_header(tmp_path: Path) -> None:
    path = block_path(tmp_path, FP, HASH)
    header = write_block_file(path, META, memoryview(PAYLOAD), fsync=True)
    assert read_block_file(path, EXPECT) == PAYLOAD
    assert read_header(path) == header
    assert header.meta == META and header.payload_len == len(PAYLOAD)
    assert header.file_size == path.stat().st_size
    assert header.payload_checksum == payload_checksum(PAYLOAD)


def test_block_path_fans_out_by_hash_prefix(tmp_path: Path) -> None:
    name = block_hash_hex(HASH)
    assert block_path(tmp_path, FP, HASH) == tmp_path / FP / name[:2] / name[2:4] / f"{name}.kvb"
    for bad in ("", "..", ".hidden", "a/b", "a b", "x" * 129):
        with pytest.raises(ValueError):
            block_path(tmp_path, bad, HASH)


def test_empty_payload_and_non_byte_memoryview(tmp_path: Path) -> None:
    path = tmp_path / "empty.kvb"
    write_block_file(path, META, b"")
    assert read_block_file(path, EXPECT) == b""
    halves = memoryview(bytearray(PAYLOAD)).cast("H")  # a 2-byte dtype view, like a bf16 tensor's
    write_block_file(path, META, halves)
    assert read_block_file(path, EXPECT) == PAYLOAD


def test_missing_and_unreadable(tmp_path: Path) -> None:
    assert fault_of(tmp_path / "nope.kvb") is BlockFileFault.MISSING
    with pytest.raises(BlockFileError):
        read_header(tmp_path / "nope.kvb")
    assert fault_of(tmp_path) is BlockFileFault.UNREADABLE  # a directory: an OSError, still a fault


def test_truncated_header_and_payload(tmp_path: Path) -> None:
    path = written(tmp_path)
    data = path.read_bytes()
    header_len = read_header(path).header_len
    for cut in (0, 5, 20, header_len - 1, header_len, len(data) - 1):
        path.write_bytes(data[:cut])
        assert fault_of(path) is BlockFileFault.TRUNCATED, cut
    path.write_bytes(data + b"x")  # trailing bytes are corruption too
    assert fault_of(path) is BlockFileFault.CORRUPT_HEADER


def test_every_flipped_payload_byte_is_caught(tmp_path: Path) -> None:
    path = written(tmp_path)
    data = bytearray(path.read_bytes())
    header_len = read_header(path).header_len
    for i in range(header_len, len(data), 997):
        flipped = bytearray(data)
        flipped[i] ^= 0x01
        path.write_bytes(flipped)
        assert fault_of(path) is BlockFileFault.CORRUPT_PAYLOAD, i


def test_every_flipped_header_byte_is_caught(tmp_path: Path) -> None:
    path = written(tmp_path)
    data = path.read_bytes()
    header_len = read_header(path).header_len
    for i in range(header_len):
        flipped = bytearray(data)
        flipped[i] ^= 0x80
        path.write_bytes(flipped)
        with pytest.raises(BlockFileError):
            read_block_file(path, EXPECT)
        with pytest.raises(BlockFileError):
            read_header(path)  # a scan never trusts a damaged header either


def test_bad_magic_and_version(tmp_path: Path) -> None:
    path = written(tmp_path)
    data = path.read_bytes()
    path.write_bytes(b"NOTKVBLK" + data[8:])
    assert fault_of(path) is BlockFileFault.BAD_MAGIC
    for version in (0, FORMAT_VERSION + 1):  # formats this reader does not know
        path.write_bytes(MAGIC + struct.pack("<H", version) + data[10:])
        assert fault_of(path) is BlockFileFault.BAD_VERSION
    path.write_bytes(b"")
    assert fault_of(path) is BlockFileFault.TRUNCATED


def test_a_valid_block_that_is_not_the_one_asked_for(tmp_path: Path) -> None:
    path = written(tmp_path)
    assert fault_of(path, replace(EXPECT, fingerprint="other-model")) is BlockFileFault.FOREIGN_MODEL
    spec = LAYOUT.kv_spec
    for layout in (
        replace(LAYOUT, kv_spec=replace(spec, num_layers=29)),
        replace(LAYOUT, kv_spec=replace(spec, num_kv_heads=1)),
        replace(LAYOUT, kv_spec=replace(spec, head_dim=128)),
        replace(LAYOUT, block_size=32),
        # An MLA entry of the same byte count is not these keys and values.
        BlockLayout(KVSpec.mla(30, 2 * 3 * 64 - 64, 64), 16),
    ):
        assert fault_of(path, replace(EXPECT, layout=layout)) is BlockFileFault.WRONG_LAYOUT
    assert fault_of(path, replace(EXPECT, dtype="float16")) is BlockFileFault.WRONG_DTYPE
    other = hash_block(HASH, list(range(16)), FP)
    assert fault_of(path, replace(EXPECT, block_hash=other)) is BlockFileFault.WRONG_HASH


def test_a_header_with_consistent_crc_but_bad_fields_is_corrupt(tmp_path: Path) -> None:
    # a writer bug rather than bit rot: the crc matches, the strings do not decode
    header = bytearray(encode_header(META, len(PAYLOAD), payload_checksum(PAYLOAD)))
    at = header.index(FP.encode())
    header[at] = 0xFF  # not utf-8
    header[-4:] = struct.pack("<I", zlib.crc32(bytes(header[:-4])))
    path = tmp_path / "bad.kvb"
    path.write_bytes(bytes(header) + PAYLOAD)
    assert fault_of(path) is BlockFileFault.CORRUPT_HEADER


def test_atomic_write_leaves_no_temp_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = written(tmp_path)
    write_block_file(path, replace(META, retention_class="agent"), PAYLOAD)  # replaces in place
    assert read_header(path).meta.retention_class == "agent"
    assert os.listdir(path.parent) == [path.name]

    def fail(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        write_block_file(path, META, b"new payload")
    assert os.listdir(path.parent) == [path.name]  # the temp file is gone, the old block intact
    assert read_block_file(path, EXPECT) == PAYLOAD


def test_touch_records_last_use_in_mtime(tmp_path: Path) -> None:
    path = written(tmp_path)
    touch_block_file(path, 123_456.0)
    assert path.stat().st_mtime == 123_456.0
    assert read_block_file(path, EXPECT) == PAYLOAD


def test_header_limits() -> None:
    with pytest.raises(ValueError):
        encode_header(replace(META, block_hash=b"\x00" * 16), 0, b"\x00" * 16)
    with pytest.raises(ValueError):
        encode_header(replace(META, dtype="x" * 5000), 0, b"\x00" * 16)


def test_a_version_1_file_is_still_read(tmp_path: Path) -> None:
    """Format 1 checked payloads with sha256: an upgraded reader keeps the store it finds."""
    path = tmp_path / "v1.kvb"
    checksum = hashlib.sha256(PAYLOAD).digest()[:16]
    path.write_bytes(encode_header(META, len(PAYLOAD), checksum, version=1) + PAYLOAD)
    assert read_header(path).version == 1
    assert read_block_file(path, EXPECT) == PAYLOAD
    path.write_bytes(encode_header(META, len(PAYLOAD), checksum, version=1) + bytes(len(PAYLOAD)))
    assert fault_of(path) is BlockFileFault.CORRUPT_PAYLOAD


def test_a_version_2_file_is_read_as_mha(tmp_path: Path) -> None:
    """Format 2 (before the KV kind was in the header) held only per-head keys and values."""
    path = tmp_path / "v2.kvb"
    path.write_bytes(encode_header(META, len(PAYLOAD), payload_checksum(PAYLOAD, 2), version=2) + PAYLOAD)
    header = read_header(path)
    assert header.version == 2 and header.meta.layout == LAYOUT
    assert read_block_file(path, EXPECT) == PAYLOAD
    mla_layout = BlockLayout(KVSpec.mla(30, 3 * 2 * 64 - 64, 64), 16)
    with pytest.raises(ValueError, match="only mha"):
        encode_header(replace(META, layout=mla_layout), 0, b"\x00" * 16, version=2)


def test_mha_blocks_are_written_in_the_format_older_readers_know(tmp_path: Path) -> None:
    """Version 2: a reader from before MLA reads them (and would delete a version it does not know)."""
    written(tmp_path)
    assert read_header(block_path(tmp_path, FP, HASH)).version == 2


def test_an_mla_block_round_trips_and_is_never_read_as_another_layout(tmp_path: Path) -> None:
    mla = BlockLayout(KVSpec.mla(61, 512, 64), 16)
    meta = replace(META, layout=mla)
    path = block_path(tmp_path, FP, HASH)
    write_block_file(path, meta, PAYLOAD)
    assert read_header(path).meta.layout == mla and read_header(path).version == FORMAT_VERSION
    assert read_block_file(path, replace(EXPECT, layout=mla)) == PAYLOAD
    # the same numbers as keys and values of one head: another layout
    as_mha = BlockLayout(KVSpec.mha(61, 1, 576), 16)
    assert fault_of(path, replace(EXPECT, layout=as_mha)) is BlockFileFault.WRONG_LAYOUT
    assert fault_of(path, replace(EXPECT, layout=LAYOUT)) is BlockFileFault.WRONG_LAYOUT
