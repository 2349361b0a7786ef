"""KVStore (the worker's G3): background writes stamped with their retention class, a save of a
block already stored or queued reporting the stronger claim, reads checked against the exact
expectation (a bad file is deleted and reported), prefetch, read-your-writes, and a store that
cannot be written stopping its writes with one warning while reads go on. Also the fingerprint."""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from libs.kvstore.block_file import (
    BlockFileError,
    BlockFileFault,
    BlockFileHeader,
    BlockLayout,
    BlockMeta,
    read_header,
    write_block_file,
)
from libs.kvstore.kv_spec import KVSpec
from libs.kvstore.retention import RetentionClass, RetentionPolicy
from libs.modelfiles.gguf_metadata import read_gguf_config
from libs.modelfiles.registry import resolve_model_path
from services.worker.kv_store import KVStore, StoredBlock, kv_fingerprint

FP = "tiny-0123456789abcdef"
LAYOUT = BlockLayout(KVSpec.mha(2, 2, 4), 4)
NUM_BYTES = 2 * 2 * 4 * 2 * 4 * 4  # fp32
POLICY = RetentionPolicy([RetentionClass("agent", 100.0, 0), RetentionClass("chat", 700.0, 1)], "agent")
NOW = 1_000_000.0


def block_hash(i: int) -> bytes:
    return bytes([i]) * 32


def payload(i: int) -> memoryview:
    return memoryview(bytes((i + j) % 251 for j in range(NUM_BYTES)))


class Stored:
    """The store's on_stored callback, recorded (it runs on the writer thread)."""

    def __init__(self) -> None:
        self.calls: list[tuple[bytes, StoredBlock]] = []

    def __call__(self, block_hash: bytes, stored: StoredBlock) -> None:
        self.calls.append((block_hash, stored))

    def claims(self) -> list[tuple[bytes, str, float]]:
        return [(h, s.retention_class, s.expires_at) for h, s in self.calls]


def make_store(root: Path, **kwargs: Any) -> KVStore:
    return KVStore(root, FP, LAYOUT, torch.float32, POLICY, clock=lambda: NOW, **kwargs)


def test_write_then_read_round_trips_with_the_retention_class_stamped(tmp_path: Path) -> None:
    stored = Stored()
    store = make_store(tmp_path, on_stored=stored)
    assert store.write(block_hash(1), payload(1), "chat")
    assert store.write(block_hash(2), payload(2), "no-such-class")  # falls back to the default
    assert store.write(block_hash(3), payload(3))
    store.flush()
    headers = {h: s.header for h, s in stored.calls}
    assert stored.claims() == [  # a fresh file's claim is its header's
        (block_hash(1), "chat", NOW + 700.0),
        (block_hash(2), "agent", NOW + 100.0),
        (block_hash(3), "agent", NOW + 100.0),
    ]
    assert headers[block_hash(1)].meta.retention_class == "chat"
    assert headers[block_hash(1)].meta.expires_at == NOW + 700.0
    assert headers[block_hash(2)].meta.retention_class == "agent"
    assert headers[block_hash(3)].meta.expires_at == NOW + 100.0
    for i in (1, 2, 3):
        path = store.path(block_hash(i))
        assert read_header(path) == headers[block_hash(i)]
        assert headers[block_hash(i)].file_size == path.stat().st_size
        os.utime(path, (5.0, 5.0))
        assert store.read(block_hash(i)) == bytes(payload(i))
        assert path.stat().st_mtime == NOW  # touched: mtime is the last use
    assert store.num_written_blocks == 3 and store.num_read_blocks == 3
    assert store.num_written_bytes == sum(h.file_size for h in headers.values())
    store.close()


def test_a_block_already_on_disk_is_not_rewritten_but_reported(tmp_path: Path) -> None:
    first = make_store(tmp_path)
    first.write(block_hash(1), payload(1), "chat")
    first.close()
    stored = Stored()
    second = make_store(tmp_path, on_stored=stored)  # another worker, or this one after a restart
    path = second.path(block_hash(1))
    os.utime(path, (7.0, 7.0))
    assert second.write(block_hash(1), payload(1), "agent")
    second.flush()
    assert second.num_written_blocks == 0 and second.num_present_blocks == 1
    assert path.stat().st_mtime == 7.0
    assert stored.claims() == [(block_hash(1), "chat", NOW + 700.0)]  # a weaker save weakens nothing
    assert stored.calls[0][1].header == read_header(path)
    second.close()


def test_a_stronger_save_of_a_stored_block_reports_the_stronger_claim(tmp_path: Path) -> None:
    now = [NOW]
    first = make_store(tmp_path)
    first.write(block_hash(1), payload(1), "agent")
    first.close()
    header = read_header(first.path(block_hash(1)))
    stored = Stored()
    store = KVStore(tmp_path, FP, LAYOUT, torch.float32, POLICY, clock=lambda: now[0], on_stored=stored)
    now[0] = NOW + 50.0
    assert store.write(block_hash(1), payload(1), "chat")
    store.flush()
    now[0] = NOW + 60.0  # agent again: its ttl from now ends later than the file's
    assert store.write(block_hash(1), payload(1), "agent")
    store.flush()
    assert stored.claims() == [
        (block_hash(1), "chat", NOW + 50.0 + 700.0),
        (block_hash(1), "agent", NOW + 60.0 + 100.0),
    ]
    assert read_header(store.path(block_hash(1))) == header  # not rewritten: a scan sees "agent"
    assert store.num_written_blocks == 0 and store.num_present_blocks == 2
    store.close()


def test_a_stronger_save_of_a_queued_block_raises_its_claim(tmp_path: Path) -> None:
    writing, release = threading.Event(), threading.Event()

    def slow_write(*args: Any, **kwargs: Any) -> BlockFileHeader:
        writing.set()  # the header is built: the class raised from now on is not in the file
        release.wait(10)
        return write_block_file(*args, **kwargs)

    stored = Stored()
    store = make_store(tmp_path, write_file=slow_write, on_stored=stored)
    assert store.write(block_hash(1), payload(1), "agent")
    assert writing.wait(10)
    assert not store.write(block_hash(1), payload(1), "chat")  # queued already: the class is raised
    assert not store.write(block_hash(1), payload(1), "agent")  # and never lowered again
    release.set()
    store.flush()
    assert stored.claims() == [(block_hash(1), "chat", NOW + 700.0)]
    assert read_header(store.path(block_hash(1))).meta.retention_class == "agent"
    assert store.num_written_blocks == 1
    store.close()


def test_a_queued_write_is_read_from_memory_queued_once_and_bounded(tmp_path: Path) -> None:
    release = threading.Event()

    def slow_write(*args: Any, **kwargs: Any) -> BlockFileHeader:
        release.wait(10)
        return write_block_file(*args, **kwargs)

    store = make_store(tmp_path, write_file=slow_write, max_pending_bytes=NUM_BYTES)
    assert store.write(block_hash(1), payload(1))
    assert not store.write(block_hash(1), payload(1))  # already queued
    assert not store.write(block_hash(2), payload(2))  # the queue is full: dropped, not waited for
    assert store.read(block_hash(1)) == bytes(payload(1))  # not on disk yet
    release.set()
    store.flush()
    assert store.num_written_blocks == 1 and store.num_dropped_writes == 1
    assert store.write(block_hash(2), payload(2))  # room again
    store.flush()
    assert store.read(block_hash(1)) == bytes(payload(1))
    store.close()


def foreign_file(path: Path) -> None:
    meta = BlockMeta(block_hash(1), "other-model", LAYOUT, "float32", "agent", NOW, NOW + 1)
    write_block_file(path, meta, payload(1))


def wrong_hash_file(path: Path) -> None:
    meta = BlockMeta(block_hash(9), FP, LAYOUT, "float32", "agent", NOW, NOW + 1)
    write_block_file(path, meta, payload(1))


def corrupt_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 5)


FAULTS = {
    "corrupt": (corrupt_payload, BlockFileFault.CORRUPT_PAYLOAD),
    "truncated": (truncate, BlockFileFault.TRUNCATED),
    "foreign": (foreign_file, BlockFileFault.FOREIGN_MODEL),
    "wrong hash": (wrong_hash_file, BlockFileFault.WRONG_HASH),
    "missing": (lambda path: path.unlink(), BlockFileFault.MISSING),
}


@pytest.mark.parametrize("prefetched", [False, True])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_bad_block_raises_its_fault_and_is_deleted(tmp_path: Path, fault: str, prefetched: bool) -> None:
    store = make_store(tmp_path)
    store.write(block_hash(1), payload(1))
    store.flush()
    path = store.path(block_hash(1))
    spoil, reason = FAULTS[fault]
    spoil(path)
    if prefetched:
        store.prefetch([block_hash(1)])
    with pytest.raises(BlockFileError) as info:
        store.read(block_hash(1))
    assert info.value.reason is reason
    assert not path.exists()
    store.close()


def test_an_unreadable_block_is_a_miss_but_kept(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    path = store.path(block_hash(1))
    path.mkdir(parents=True)  # EISDIR on open: an I/O error, which may pass, so nothing is deleted
    with pytest.raises(BlockFileError) as info:
        store.read(block_hash(1))
    assert info.value.reason is BlockFileFault.UNREADABLE and path.is_dir()
    store.close()


def test_prefetch_is_joined_by_the_read_and_discarded_on_request(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    for i in (1, 2):
        store.write(block_hash(i), payload(i))
    store.flush()
    store.prefetch([block_hash(1), block_hash(2)])
    assert store.read(block_hash(1)) == bytes(payload(1))
    store.discard_prefetch(block_hash(2))
    assert store.read(block_hash(2)) == bytes(payload(2))  # read now instead
    store.close()


def enospc(*args: Any, **kwargs: Any) -> BlockFileHeader:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def unwritable_stores(tmp_path: Path) -> dict[str, KVStore]:
    as_file = tmp_path / "a-file"
    as_file.write_bytes(b"not a directory")
    stores = {
        "root is a file": make_store(as_file),
        "disk full": make_store(tmp_path / "full", write_file=enospc),
    }
    if os.geteuid() != 0:  # root ignores permissions
        read_only = tmp_path / "read-only"
        read_only.mkdir(mode=0o500)
        stores["read-only dir"] = make_store(read_only)
    return stores


def test_an_unwritable_store_warns_once_and_stops_writing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for name, store in unwritable_stores(tmp_path).items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="services.worker.kv_store"):
            store.write(block_hash(1), payload(1))
            store.write(block_hash(2), payload(2))
            store.flush()
            assert not store.write(block_hash(3), payload(3))
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, name
        assert "unwritable" in warnings[0].getMessage()
        assert "serving on without G3 writes" in warnings[0].getMessage()
        assert not store.writable and store.num_write_failures == 1, name
        store.prefetch([block_hash(1)])
        with pytest.raises(BlockFileError):  # reads go on: a block never written is a miss
            store.read(block_hash(1))
        store.close()


def test_blocks_written_before_a_write_failure_are_still_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[Path] = []

    def full_after_one(path: Path, *args: Any, **kwargs: Any) -> BlockFileHeader:
        calls.append(path)
        return write_block_file(path, *args, **kwargs) if len(calls) == 1 else enospc()

    store = make_store(tmp_path, write_file=full_after_one)
    assert store.write(block_hash(1), payload(1))
    store.flush()
    with caplog.at_level(logging.WARNING, logger="services.worker.kv_store"):
        assert store.write(block_hash(2), payload(2))
        store.flush()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert not store.writable and store.num_write_failures == 1
    assert not store.write(block_hash(3), payload(3))
    assert store.read(block_hash(1)) == bytes(payload(1))
    store.prefetch([block_hash(1)])
    assert store.read(block_hash(1)) == bytes(payload(1))
    with pytest.raises(BlockFileError) as info:
        store.read(block_hash(2))
    assert info.value.reason is BlockFileFault.MISSING
    store.close()


def test_a_bad_fingerprint_is_refused_up_front(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="safe directory name"):
        KVStore(tmp_path, "../escape", LAYOUT, torch.float32)


def test_fingerprint_is_stable_and_tells_models_apart(tmp_path: Path) -> None:
    model = tmp_path / "Tiny Model.Q4_1.gguf"
    model.write_bytes(b"GGUF" + bytes(range(256)) * 10)
    other = tmp_path / "tiny.gguf"
    other.write_bytes(b"GGUF" + bytes(range(255)) * 10)
    layout = KVSpec.mha(2, 2, 16)
    fp = kv_fingerprint(model, "float32", torch.float32, layout)
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", fp) and fp.startswith("Tiny-Model-")
    assert fp == kv_fingerprint(model, "float32", torch.float32, layout)
    variants = {
        kv_fingerprint(other, "float32", torch.float32, layout),
        kv_fingerprint(model, "bfloat16", torch.bfloat16, layout),
        kv_fingerprint(model, "int8", torch.bfloat16, layout),
        kv_fingerprint(model, "float32", torch.float32, KVSpec.mha(2, 1, 32)),
    }
    assert fp not in variants and len(variants) == 4


def test_the_embedded_models_fingerprint_is_what_it_was_before_kv_specs(tmp_path: Path) -> None:
    """The G3 paths of blocks stored before MLA existed: a llama worker still finds them. The value
    was computed by the code before the KV spec (layers, heads, head dim; no kind)."""
    path = resolve_model_path("smollm2")
    spec = read_gguf_config(path).kv_spec()
    assert kv_fingerprint(path, "bfloat16", torch.bfloat16, spec) == "SmolLM2-135M-Instruct-2a55c46d17a525fd"
    assert kv_fingerprint(path, "bfloat16", torch.bfloat16, KVSpec.mla(30, 128, 64)) != kv_fingerprint(
        path, "bfloat16", torch.bfloat16, KVSpec.mha(30, 1, 192)
    )
