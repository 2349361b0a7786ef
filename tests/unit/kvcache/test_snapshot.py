"""The index snapshot: a round trip keeps every G3 entry exactly; anything doubtful is refused."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from libs.kvstore.block_hash import hash_block
from libs.kvstore.retention import RetentionClass, RetentionPolicy
from services.kvcache.index import BlockEntry, BlockIndex, Placement, Tier
from services.kvcache.snapshot import (
    SnapshotError,
    SnapshotFault,
    load_snapshot,
    remove_stale_temps,
    snapshot_path,
    write_snapshot,
)
from services.kvcache.store_scan import collect_garbage
from tests.unit.kvcache.test_store_scan import DAY, FPS, NOW, POLICY, block_files, index_of, put


def entries(index: BlockIndex) -> list[BlockEntry]:
    return sorted(index.entries(Tier.G3), key=lambda e: e.block_hash)


def make_index(root: Path) -> BlockIndex:
    """Blocks of two models and both classes, one used since it was stored, plus a G2 entry."""
    put(root, 1, cls="chat", age=DAY)
    put(root, 2, fp=FPS[1], age=2 * DAY)
    put(root, 3)
    index = BlockIndex(POLICY)
    report = collect_garbage(index, root, NOW, 1 << 30, adopt_orphans=True)
    assert len(report.adopted) == 3
    index.touch(hash_block(None, [2], FPS[1]), NOW + 5.0, "chat")  # a later use, a stronger class
    index.insert(hash_block(None, [9], FPS[0]), Placement(Tier.G2, 7, 100, FPS[0]), NOW)
    index.check_integrity()
    return index


def test_round_trip_keeps_every_g3_entry(tmp_path: Path) -> None:
    index = make_index(tmp_path)
    size = write_snapshot(index, tmp_path, NOW)
    assert snapshot_path(tmp_path).stat().st_size == size
    loaded = load_snapshot(tmp_path, POLICY)
    loaded.check_integrity()
    assert entries(loaded) == entries(index)  # same locations, sizes, classes, last uses, expiries
    assert len(loaded) == 3  # the G2 entry is the worker's memory: not saved
    assert index_of(loaded) == block_files(tmp_path)
    assert list(tmp_path.glob(".kvcache-index.*")) == []  # the temp file was renamed


def test_a_store_scan_leaves_the_snapshot_alone(tmp_path: Path) -> None:
    index = make_index(tmp_path)
    write_snapshot(index, tmp_path, NOW)
    report = collect_garbage(index, tmp_path, NOW, 1 << 30)
    assert snapshot_path(tmp_path) in report.unknown and snapshot_path(tmp_path).exists()


def test_missing(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError) as err:
        load_snapshot(tmp_path, POLICY)
    assert err.value.reason is SnapshotFault.MISSING


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "empty"])
def test_a_damaged_snapshot_is_refused(tmp_path: Path, damage: str) -> None:
    write_snapshot(make_index(tmp_path), tmp_path, NOW)
    path = snapshot_path(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x10
    elif damage == "truncate":
        del data[-5:]
    elif damage == "magic":
        data[0] ^= 1
    else:
        data = bytearray()
    path.write_bytes(data)
    with pytest.raises(SnapshotError) as err:
        load_snapshot(tmp_path, POLICY)
    assert err.value.reason is SnapshotFault.CORRUPT


def test_another_format_version_is_refused(tmp_path: Path) -> None:
    write_snapshot(make_index(tmp_path), tmp_path, NOW)
    path = snapshot_path(tmp_path)
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, 8, 99)  # the version field follows the 8-byte magic
    path.write_bytes(data)
    with pytest.raises(SnapshotError) as err:
        load_snapshot(tmp_path, POLICY)
    assert err.value.reason is SnapshotFault.BAD_VERSION


def test_a_snapshot_of_another_root_is_refused(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_snapshot(make_index(a), a, NOW)
    b.mkdir()
    snapshot_path(b).write_bytes(snapshot_path(a).read_bytes())
    with pytest.raises(SnapshotError) as err:
        load_snapshot(b, POLICY)
    assert err.value.reason is SnapshotFault.OTHER_ROOT


def test_a_class_no_longer_configured_becomes_the_default(tmp_path: Path) -> None:
    wide = RetentionPolicy((*POLICY.classes.values(), RetentionClass("batch", DAY, priority=2)))
    index = BlockIndex(wide)
    block_hash = hash_block(None, [1], FPS[0])
    put(tmp_path, 1)
    collect_garbage(index, tmp_path, NOW, 1 << 30, adopt_orphans=True)
    index.touch(block_hash, NOW, "batch")
    write_snapshot(index, tmp_path, NOW)
    entry = load_snapshot(tmp_path, POLICY).get(block_hash)
    assert entry is not None and entry.retention_class == POLICY.default.name


def test_stale_temp_files_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".kvcache-index.0123456789ab.tmp"
    stale.write_bytes(b"half a snapshot")
    write_snapshot(BlockIndex(POLICY), tmp_path, NOW)
    assert remove_stale_temps(tmp_path) == [stale]
    assert not stale.exists() and snapshot_path(tmp_path).exists()
    assert len(load_snapshot(tmp_path, POLICY)) == 0
