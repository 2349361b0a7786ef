"""Scanning, rebuilding and garbage-collecting a real store directory (tmp_path).

The property test builds random stores (valid, orphan, dangling, corrupt, misplaced and temp files,
two models) and checks that after ``collect_garbage`` the index's G3 entries and the block files on
disk are exactly the same set, within capacity, with nothing expired left; with a payload scrub,
nothing damaged is left either.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.kvstore.block_file import (
    BlockFileError,
    BlockFileFault,
    BlockFileHeader,
    BlockLayout,
    BlockMeta,
    block_path,
    read_header,
    write_block_file,
)
from libs.kvstore.block_hash import hash_block
from libs.kvstore.kv_spec import KVSpec
from libs.kvstore.retention import RetentionPolicy
from services.kvcache import store_scan
from services.kvcache.index import BlockIndex, Placement, Tier
from services.kvcache.store_scan import (
    IssueKind,
    ScanIssue,
    ScannedBlock,
    collect_garbage,
    rebuild_index,
    scan_store,
    trim_store,
)

POLICY = RetentionPolicy()
FPS = ("model-a", "model-b")
LAYOUT = BlockLayout(KVSpec.mha(2, 1, 4), 2)
DAY = 86_400.0
NOW = 1_700_000_000.0


def put(root: Path, i: int, *, fp: str = FPS[0], cls: str = "agent", age: float = 0.0, size: int = 8) -> Path:
    """Write block ``i`` stored ``age`` seconds before NOW (its mtime too); returns its path."""
    block_hash = hash_block(None, [i], fp)
    stored_at = NOW - age
    expires_at = POLICY.get(cls).expires_at(stored_at)
    meta = BlockMeta(block_hash, fp, LAYOUT, "bfloat16", cls, stored_at, expires_at)
    path = block_path(root, fp, block_hash)
    write_block_file(path, meta, bytes(size))
    os.utime(path, (stored_at, stored_at))
    return path


def index_of(index: BlockIndex) -> set[str]:
    return {str(e.placement.location) for e in index.entries(Tier.G3)}


def block_files(root: Path) -> set[str]:
    return {str(p) for p in root.rglob("*.kvb")}


def test_scan_classifies_every_file(tmp_path: Path) -> None:
    good = put(tmp_path, 1)
    corrupt = put(tmp_path, 2)
    corrupt.write_bytes(corrupt.read_bytes()[:-1])
    misplaced = put(tmp_path, 3)
    moved = tmp_path / FPS[1] / misplaced.relative_to(tmp_path / FPS[0])  # a model-a block in model-b
    moved.parent.mkdir(parents=True)
    misplaced.rename(moved)
    temp = good.with_name(f".{good.name}.abc.tmp")
    temp.write_bytes(b"partial")
    stray = [good.with_name("notes.txt"), tmp_path / "README", tmp_path / FPS[0] / "zz"]
    for p in stray:
        p.write_bytes(b"?")
    (tmp_path / ".snapshot").mkdir()
    items = {str(item.path): item for item in scan_store(tmp_path)}
    assert isinstance(items[str(good)], ScannedBlock)
    kinds = {p: item.kind for p, item in items.items() if isinstance(item, ScanIssue)}
    assert kinds == {
        str(corrupt): IssueKind.CORRUPT,
        str(moved): IssueKind.MISPLACED,
        str(temp): IssueKind.TEMP,
        **{str(p): IssueKind.UNKNOWN for p in stray},
        str(tmp_path / ".snapshot"): IssueKind.UNKNOWN,
    }
    bad = items[str(corrupt)]
    assert isinstance(bad, ScanIssue) and bad.fault is BlockFileFault.TRUNCATED
    assert [i.path for i in scan_store(tmp_path, FPS[1])] == [moved]
    assert list(scan_store(tmp_path / "absent")) == []


def test_scan_can_verify_payloads(tmp_path: Path) -> None:
    path = put(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(data)
    assert isinstance(next(scan_store(tmp_path)), ScannedBlock)  # headers only: cheap, blind to it
    issue = next(scan_store(tmp_path, verify_payload=True))
    assert isinstance(issue, ScanIssue) and issue.fault is BlockFileFault.CORRUPT_PAYLOAD


def test_rebuild_reads_headers_and_mtimes(tmp_path: Path) -> None:
    chat = put(tmp_path, 1, cls="chat", age=DAY)
    agent = put(tmp_path, 2, fp=FPS[1], age=2 * DAY)
    os.utime(agent, (NOW, NOW))  # used since it was stored
    put(tmp_path, 3).write_bytes(b"garbage")
    index, issues = rebuild_index(tmp_path, POLICY)
    index.check_integrity()
    assert index_of(index) == {str(chat), str(agent)}
    assert [i.kind for i in issues] == [IssueKind.CORRUPT]
    e_chat = index.get(hash_block(None, [1], FPS[0]))
    e_agent = index.get(hash_block(None, [2], FPS[1]))
    assert e_chat is not None and e_agent is not None
    assert (e_chat.retention_class, e_chat.expires_at) == ("chat", NOW - DAY + 7 * DAY)
    assert (e_agent.last_use, e_agent.expires_at) == (NOW, NOW + 3 * DAY)
    assert e_agent.placement.size_bytes == agent.stat().st_size
    assert e_agent.placement.fingerprint == FPS[1]


def test_rebuild_maps_an_unknown_class_to_the_default(tmp_path: Path) -> None:
    put(tmp_path, 1, cls="chat")
    index, _ = rebuild_index(tmp_path, RetentionPolicy([replace(POLICY.get("agent"))]))
    assert [e.retention_class for e in index.entries()] == ["agent"]


def test_collect_garbage_cases(tmp_path: Path) -> None:
    kept = put(tmp_path, 1, cls="chat", age=DAY)
    expired = put(tmp_path, 2, age=4 * DAY)
    old_orphan = put(tmp_path, 3, age=DAY)
    young_orphan = put(tmp_path, 4, age=60.0)
    corrupt = put(tmp_path, 5, age=DAY)
    index, _ = rebuild_index(tmp_path, POLICY)
    for p in (old_orphan, young_orphan):
        index.remove(next(e.block_hash for e in index.entries() if e.placement.location == str(p)))
    corrupt.write_bytes(b"DIKVBLK\x00 scrambled")
    dangling = hash_block(None, [6], FPS[0])
    index.insert(dangling, Placement(Tier.G3, str(tmp_path / "gone.kvb"), 8, FPS[0]), NOW)
    host = hash_block(None, [7], FPS[0])
    index.insert(host, Placement(Tier.G2, 3, 8, FPS[0]), NOW)  # G2: not the store's business
    old_temp, new_temp = kept.with_name(".a.tmp"), kept.with_name(".b.tmp")
    for p, age in ((old_temp, 2 * 3600.0), (new_temp, 10.0)):
        p.write_bytes(b"")
        os.utime(p, (NOW - age, NOW - age))

    report = collect_garbage(index, tmp_path, NOW, capacity_bytes=10**9)
    index.check_integrity()
    assert index_of(index) == {str(kept)} and index.get(host) is not None
    assert block_files(tmp_path) == {str(kept), str(young_orphan)}
    assert report.deleted_orphans == [old_orphan] and report.young_orphans == [young_orphan]
    assert [i.path for i in report.deleted_bad] == [corrupt]
    assert {e.block_hash for e in report.dangling} == {dangling, hash_block(None, [5], FPS[0])}
    assert [e.placement.location for e in report.expired] == [str(expired)]
    assert report.deleted_temp == [old_temp] and new_temp.exists()
    assert report.evicted == [] and report.errors == [] and report.num_files_scanned == 7


def test_an_unreadable_file_is_neither_deleted_nor_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = put(tmp_path, 1, age=60.0)
    index, _ = rebuild_index(tmp_path, POLICY)

    def flaky(p: Path | str) -> BlockFileHeader:
        if Path(p) == path:
            raise BlockFileError(p, BlockFileFault.UNREADABLE, "EIO")
        return read_header(p)

    monkeypatch.setattr(store_scan, "read_header", flaky)  # what the scan calls
    report = collect_garbage(index, tmp_path, NOW, capacity_bytes=10**9)
    assert report.unknown == [path] and report.dangling == [] and path.exists()
    assert index_of(index) == {str(path)}


def test_trim_store_evicts_by_policy_to_capacity(tmp_path: Path) -> None:
    paths = [put(tmp_path, i, cls="chat" if i % 2 else "agent", age=100.0 - i) for i in range(6)]
    index, _ = rebuild_index(tmp_path, POLICY)
    size = paths[0].stat().st_size
    report = trim_store(index, NOW, capacity_bytes=3 * size)
    # agent blocks (0, 2, 4) first, oldest first; then the chat blocks stay
    assert [e.placement.location for e in report.evicted] == [str(paths[i]) for i in (0, 2, 4)]
    assert block_files(tmp_path) == index_of(index) == {str(paths[i]) for i in (1, 3, 5)}
    assert report.num_bytes_freed == 3 * size


states = st.sampled_from(["indexed", "orphan", "dangling", "corrupt", "misplaced", "temp"])
blocks = st.lists(
    st.tuples(
        states,
        st.sampled_from(FPS),
        st.sampled_from(["agent", "chat"]),
        st.floats(0.0, 8 * DAY),  # age
        st.integers(0, 64),  # payload bytes
    ),
    max_size=14,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks, st.integers(0, 2_000), st.floats(0.0, 2 * DAY), st.booleans())
def test_after_gc_the_index_is_the_store(
    specs: list[tuple[str, str, str, float, int]], capacity: int, later: float, scrub: bool
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i, (state, fp, cls, age, size) in enumerate(specs):
            path = put(root, i, fp=fp, cls=cls, age=age, size=size)
            if state == "corrupt":
                path.write_bytes(path.read_bytes()[:-1] + b"!")
            elif state == "misplaced":
                path.rename(path.with_name(path.name.replace(path.name[:2], "00", 1)))
            elif state == "temp":
                path.rename(path.with_name(f".{path.name}.x.tmp"))
        index, _ = rebuild_index(root, POLICY)  # corrupt payloads look fine from their headers
        for i, (state, fp, *_) in enumerate(specs):
            block_hash = hash_block(None, [i], fp)
            if state == "orphan":
                index.remove(block_hash)
            elif state == "dangling":
                block_path(root, fp, block_hash).unlink()
        now = NOW + later
        collect_garbage(
            index, root, now, capacity, orphan_grace_s=0.0, temp_grace_s=0.0, verify_payload=scrub
        )
        index.check_integrity()
        assert index_of(index) == block_files(root)
        assert not any(root.rglob("*.tmp"))
        assert index.num_bytes(Tier.G3) <= capacity
        assert all(e.expires_at > now for e in index.entries())
        for e in index.entries():
            assert e.placement.size_bytes == Path(str(e.placement.location)).stat().st_size
        if scrub:  # every damaged file is gone, not only the ones with a damaged header
            assert all(isinstance(item, ScannedBlock) for item in scan_store(root, verify_payload=True))
