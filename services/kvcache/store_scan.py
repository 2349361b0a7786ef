"""Reconcile the block index with the files of a G3 store: scan headers, rebuild, collect garbage.

Blocking file I/O, no asyncio: the service runs these in a worker thread, and nothing else may
change the index during ``rebuild_index`` or ``collect_garbage``. One index owns one store root
(every model directory under it); G3 entries' locations are ``str(block_path(root, ...))``.

    root/<fingerprint>/<ab>/<cd>/<hash hex>.kvb     a block (libs.kvstore.block_file)
    root/<fingerprint>/<ab>/<cd>/.<name>.<rand>.tmp  a write in flight, or left by a dead writer

After ``collect_garbage`` the index's G3 entries and the valid block files are the same set, except
for files younger than ``orphan_grace_s`` that no entry names yet: a worker writes a file before
the kvcache service hears of it (``BlockStored``), and deleting such a file would race the writer.
With ``adopt_orphans`` there is no such exception: a valid file no entry names is indexed from its
header instead of deleted (the store is the truth for G3: a resync after lost events, or a start
from a snapshot older than the store).
Files that are not ours (other names, other directory shapes) and files an I/O error kept from
being read (EIO on a network mount may pass) are reported and left alone, with their entries.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from libs.kvstore.block_file import (
    BLOCK_FILE_SUFFIX,
    BlockFileError,
    BlockFileFault,
    BlockFileHeader,
    Expectation,
    block_path,
    is_temp_name,
    read_block_file,
    read_header,
)
from libs.kvstore.block_hash import block_hash_from_hex
from libs.kvstore.retention import RetentionPolicy
from services.kvcache.index import BlockEntry, BlockIndex, Placement, Tier

_FANOUT_DIR: Final = re.compile(r"[0-9a-f]{2}")


class IssueKind(enum.Enum):
    CORRUPT = "corrupt"  # the header (or, verifying, the payload) is bad: ``fault`` says how
    MISPLACED = "misplaced"  # a valid block at a path its header does not map to (wrong model dir)
    TEMP = "temp"  # a writer's temp file
    UNREADABLE = "unreadable"  # an I/O error: perhaps transient, so never deleted
    UNKNOWN = "unknown"  # not a block file layout we know; never deleted


@dataclass(frozen=True, slots=True)
class ScanIssue:
    path: Path
    kind: IssueKind
    mtime: float = 0.0
    fault: BlockFileFault | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ScannedBlock:
    path: Path
    header: BlockFileHeader
    mtime: float  # last use if the service touches files (``touch_block_file``), else write time


@dataclass(slots=True)
class GcReport:
    num_files_scanned: int = 0
    deleted_bad: list[ScanIssue] = field(default_factory=list)  # corrupt or misplaced
    deleted_temp: list[Path] = field(default_factory=list)
    deleted_orphans: list[Path] = field(default_factory=list)  # valid, but no entry names them
    adopted: list[Path] = field(default_factory=list)  # valid, no entry named them: indexed now
    young_orphans: list[Path] = field(default_factory=list)  # kept: their BlockStored may be on its way
    unknown: list[Path] = field(default_factory=list)  # not ours, or unreadable this time
    dangling: list[BlockEntry] = field(default_factory=list)  # entries whose file is gone
    expired: list[BlockEntry] = field(default_factory=list)
    evicted: list[BlockEntry] = field(default_factory=list)
    errors: list[tuple[Path, str]] = field(default_factory=list)  # deletions that failed

    @property
    def num_bytes_freed(self) -> int:
        return sum(e.placement.size_bytes for e in (*self.expired, *self.evicted))


def _sorted_entries(directory: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as it:
            return sorted(it, key=lambda e: e.name)
    except FileNotFoundError:  # removed under us, or a store not created yet
        return []


def _mtime(entry: os.DirEntry[str]) -> float:
    try:
        return entry.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _walk(root: Path, fingerprint: str | None) -> Iterator[tuple[os.DirEntry[str], bool]]:
    """Every entry of the store tree, paired with whether it sits where block files live."""
    for model_dir in _sorted_entries(root):
        if fingerprint is not None and model_dir.name != fingerprint:
            continue
        if not model_dir.is_dir() or model_dir.name.startswith("."):
            yield model_dir, False  # e.g. an NFS .snapshot directory: not ours
            continue
        for outer in _sorted_entries(Path(model_dir.path)):
            if not (outer.is_dir() and _FANOUT_DIR.fullmatch(outer.name)):
                yield outer, False
                continue
            for inner in _sorted_entries(Path(outer.path)):
                if not (inner.is_dir() and _FANOUT_DIR.fullmatch(inner.name)):
                    yield inner, False
                    continue
                for leaf in _sorted_entries(Path(inner.path)):
                    yield leaf, leaf.is_file()


def _classify(root: Path, leaf: os.DirEntry[str], verify_payload: bool) -> ScannedBlock | ScanIssue:
    path, mtime = Path(leaf.path), _mtime(leaf)
    if is_temp_name(leaf.name):
        return ScanIssue(path, IssueKind.TEMP, mtime)
    if not leaf.name.endswith(BLOCK_FILE_SUFFIX):
        return ScanIssue(path, IssueKind.UNKNOWN, mtime)
    try:
        header = read_header(path)
        meta = header.meta
        if verify_payload:
            read_block_file(path, Expectation(meta.block_hash, meta.fingerprint, meta.layout, meta.dtype))
    except BlockFileError as e:
        kind = IssueKind.UNREADABLE if e.reason is BlockFileFault.UNREADABLE else IssueKind.CORRUPT
        return ScanIssue(path, kind, mtime, e.reason, e.detail)
    try:
        expected_path = block_path(root, meta.fingerprint, meta.block_hash)
    except ValueError as e:  # a fingerprint that cannot name a directory
        return ScanIssue(path, IssueKind.MISPLACED, mtime, detail=str(e))
    if expected_path != path:
        return ScanIssue(path, IssueKind.MISPLACED, mtime, detail=f"belongs at {expected_path}")
    return ScannedBlock(path, header, mtime)


def scan_store(
    root: Path | str, fingerprint: str | None = None, *, verify_payload: bool = False
) -> Iterator[ScannedBlock | ScanIssue]:
    """Every file under ``root`` (only ``root/<fingerprint>`` if given), as a checked header or an
    issue. Headers are checked (magic, version, crc, size, placement); ``verify_payload`` also reads
    and checksums every payload (a scrub: slow)."""
    root = Path(root)
    for entry, is_leaf_file in _walk(root, fingerprint):
        if is_leaf_file:
            yield _classify(root, entry, verify_payload)
        else:
            yield ScanIssue(Path(entry.path), IssueKind.UNKNOWN, _mtime(entry))


def rebuild_index(
    root: Path | str, policy: RetentionPolicy, *, verify_payload: bool = False
) -> tuple[BlockIndex, list[ScanIssue]]:
    """An index of every valid block file under ``root``, and the files skipped (read-only: nothing
    is deleted here; ``collect_garbage`` does that).

    A block's last use is its file's mtime if later than its storing; its expiry is the later of
    its header's and last use + ttl. A class the policy no longer defines becomes the default.
    """
    index = BlockIndex(policy)
    issues: list[ScanIssue] = []
    for item in scan_store(root, verify_payload=verify_payload):
        if isinstance(item, ScanIssue):
            issues.append(item)
        else:
            _insert_scanned(index, item)
    return index, issues


def _insert_scanned(index: BlockIndex, item: ScannedBlock) -> None:
    meta = item.header.meta
    cls = index.policy.classes.get(meta.retention_class, index.policy.default)
    last_use = max(meta.stored_at, item.mtime)
    placement = Placement(Tier.G3, str(item.path), item.header.file_size, meta.fingerprint)
    expires_at = max(meta.expires_at, cls.expires_at(last_use))
    index.insert(meta.block_hash, placement, last_use, cls.name, expires_at=expires_at)


def _delete(path: Path, report: GcReport) -> bool:
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        report.errors.append((path, str(e)))
        return False
    return True


def _names(entry: BlockEntry | None, path: Path) -> bool:
    """Whether ``entry`` is the G3 entry of the file at ``path`` (a relative root still matches)."""
    if entry is None or entry.placement.tier is not Tier.G3:
        return False
    location = entry.placement.location
    return isinstance(location, str) and os.path.abspath(location) == os.path.abspath(path)


def _hash_of_name(path: Path) -> bytes | None:
    try:
        return block_hash_from_hex(path.name.removesuffix(BLOCK_FILE_SUFFIX))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class _GcOptions:
    orphan_grace_s: float
    temp_grace_s: float
    verify_payload: bool
    adopt_orphans: bool


def _reconcile_files(
    index: BlockIndex, root: Path, now: float, opts: _GcOptions, report: GcReport
) -> set[bytes]:
    """Delete bad, stale temp and orphan files (or adopt orphans); returns the hashes whose entry
    has its file."""
    orphan_grace_s, temp_grace_s = opts.orphan_grace_s, opts.temp_grace_s
    present: set[bytes] = set()
    for item in scan_store(root, verify_payload=opts.verify_payload):
        report.num_files_scanned += 1
        if isinstance(item, ScannedBlock):
            block_hash = item.header.meta.block_hash
            entry = index.get(block_hash)
            if _names(entry, item.path):
                present.add(block_hash)
                if entry is not None and item.mtime > entry.last_use:  # a use the file kept (touched
                    index.touch(block_hash, item.mtime)  # after the snapshot the index came from)
                continue
            if opts.adopt_orphans:
                _insert_scanned(index, item)
                present.add(block_hash)
                report.adopted.append(item.path)
            elif item.mtime > now - orphan_grace_s:
                report.young_orphans.append(item.path)
            elif _delete(item.path, report):
                report.deleted_orphans.append(item.path)
        elif item.kind in (IssueKind.CORRUPT, IssueKind.MISPLACED):
            if _delete(item.path, report):
                report.deleted_bad.append(item)
        elif item.kind is IssueKind.TEMP:
            if item.mtime <= now - temp_grace_s and _delete(item.path, report):
                report.deleted_temp.append(item.path)
        else:
            report.unknown.append(item.path)
            if item.kind is IssueKind.UNREADABLE:  # keep its entry: the error may pass
                named = _hash_of_name(item.path)
                if named is not None and _names(index.get(named), item.path):
                    present.add(named)
    return present


def trim_store(
    index: BlockIndex, now: float, capacity_bytes: int, report: GcReport | None = None
) -> GcReport:
    """Drop expired G3 blocks, then evict by policy until the store fits ``capacity_bytes``,
    deleting their files. No scan: the cheap step a service can run often."""
    report = GcReport() if report is None else report
    expired = index.expire(now, Tier.G3)
    evicted = index.evict_for(0, capacity_bytes, now, Tier.G3)
    report.expired.extend(expired)
    report.evicted.extend(evicted)
    for entry in (*expired, *evicted):
        location = entry.placement.location
        if isinstance(location, str):
            _delete(Path(location), report)  # a failure leaves an orphan: the next scan retries
    return report


def collect_garbage(
    index: BlockIndex,
    root: Path | str,
    now: float,
    capacity_bytes: int,
    *,
    orphan_grace_s: float = 600.0,
    temp_grace_s: float = 3600.0,
    verify_payload: bool = False,
    adopt_orphans: bool = False,
) -> GcReport:
    """Make the index and the store under ``root`` agree, then trim the store to ``capacity_bytes``.

    Deletes corrupt and misplaced files, temp files older than ``temp_grace_s``, and valid files
    older than ``orphan_grace_s`` that no G3 entry names; removes G3 entries whose file is missing
    or invalid (dangling); then ``trim_store``. ``verify_payload`` also checksums every payload (a
    scrub; otherwise a damaged payload is only found, and refused, when a worker reads it).
    ``adopt_orphans`` indexes valid files that no entry names (as ``rebuild_index`` would) instead
    of deleting them.
    """
    report = GcReport()
    opts = _GcOptions(orphan_grace_s, temp_grace_s, verify_payload, adopt_orphans)
    present = _reconcile_files(index, Path(root), now, opts, report)
    for entry in index.entries(Tier.G3):
        if entry.block_hash not in present:
            index.remove(entry.block_hash)
            report.dangling.append(entry)
    return trim_store(index, now, capacity_bytes, report)
