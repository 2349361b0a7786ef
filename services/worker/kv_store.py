"""G3 from the worker's side: write KV blocks to the shared store directory and read them back.

Writes never run on the step path: ``write`` takes a payload the caller will not touch again (a
copy made before the forward) and queues it for one writer thread. Reads run where they are asked
for, or earlier on a small pool of reader threads (``prefetch``), so a plan queued behind the
running step has its blocks off the disk by the time it runs.

Every read goes through ``read_block_file`` with the exact expectation (fingerprint, layout, dtype,
hash): a block that fails any check raises ``BlockFileError`` to the caller, which recomputes it;
the bad file is deleted first so no other reader trips on it (one that could not be read at all,
an I/O error, is kept: that may pass). A block still queued for writing is read from memory.

A save of a block already on disk (or still queued) reports the stronger of the two claims: the
class ``RetentionPolicy.stronger`` picks and the later expiry. The file is not rewritten for it.

The store is best effort: on the first ``OSError`` of a write (a full disk, a read-only mount, a
root that is a file) it logs one warning and stops writing, and the worker serves on without G3
writes. Reads stay on: what was written before still serves, and a read that fails is a miss of
that one block (the caller recomputes it), so one bad write must not cost every good block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Final

import torch

from libs.kvstore.block_file import (
    BlockFileError,
    BlockFileFault,
    BlockFileHeader,
    BlockLayout,
    BlockMeta,
    Expectation,
    block_path,
    read_block_file,
    read_header,
    touch_block_file,
    write_block_file,
)
from libs.kvstore.kv_spec import MHA, KVSpec
from libs.kvstore.retention import RetentionClass, RetentionPolicy, UnknownRetentionClass
from libs.modelfiles.registry import model_fingerprint

log = logging.getLogger(__name__)

_MAX_PREFETCHED: Final = 4096  # reads kept for a load that may never come (a step that failed)
_UNSAFE: Final = re.compile(r"[^A-Za-z0-9._-]+")

WriteFn = Callable[..., BlockFileHeader]  # write_block_file's signature


@dataclasses.dataclass(frozen=True, slots=True)
class StoredBlock:
    """What a store event reports of one block: its file, and the claim on it, which is the file's
    class and expiry, or stronger when a save asked for more than the file's header says."""

    header: BlockFileHeader  # as on disk
    retention_class: str
    expires_at: float


OnStored = Callable[[bytes, StoredBlock], None]


@dataclasses.dataclass(slots=True)
class _QueuedWrite:
    payload: memoryview
    cls: RetentionClass  # raised under the store's lock by a later save asking for a stronger one


def kv_fingerprint(
    model_path: Path, weights: str, dtype: torch.dtype, kv_spec: KVSpec, rank_layout: str = ""
) -> str:
    """The identity of the KV a model computes, folded into every block hash and G3 path:
    ``<model stem>-<16 hex>`` over the model's content fingerprint, the weight format (int8 / int4
    weights change the KV too), the KV dtype and spec, and the rank layout of a tensor-parallel
    worker (RankLayout.describe: '' for one rank). Stable across restarts and machines. An MHA
    spec hashes as the layouts before MLA did (no kind), so the blocks stored then are still read.
    Different layouts never share blocks: their KV is rounded differently (an all-reduce sums the
    ranks' parts in its own order)."""
    shape = dataclasses.astuple(kv_spec)
    parts = (
        model_fingerprint(model_path),
        weights,
        str(dtype),
        *(shape[1:] if kv_spec.kind == MHA else shape),
        *((rank_layout,) if rank_layout else ()),
    )
    digest = hashlib.sha256("|".join(map(str, parts)).encode())
    stem = _UNSAFE.sub("-", model_path.name.split(".")[0]).strip("._-")[:100] or "model"
    return f"{stem}-{digest.hexdigest()[:16]}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class KVStore:
    """One model's blocks in the store at ``root`` (``root/<fingerprint>/..``)."""

    def __init__(
        self,
        root: Path | str,
        fingerprint: str,
        layout: BlockLayout,
        dtype: torch.dtype,
        policy: RetentionPolicy | None = None,
        *,
        fsync: bool = False,
        on_stored: OnStored | None = None,
        num_readers: int = 2,
        max_pending_bytes: int = 256 << 20,
        write_file: WriteFn = write_block_file,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = Path(root)
        self.fingerprint = fingerprint
        block_path(self.root, fingerprint, bytes(32))  # a bad fingerprint fails here, not mid-write
        self.layout = layout
        self.dtype = dtype
        self.policy = policy if policy is not None else RetentionPolicy()
        self.fsync = fsync
        self.on_stored = on_stored
        # one block's payload: [num_layers, 2 (key, value), block_size, num_kv_heads, head_dim]
        self.block_shape = layout.kv_spec.block_shape(layout.block_size)
        self.block_num_bytes = math.prod(self.block_shape) * torch.empty((), dtype=dtype).element_size()
        self._write_file = write_file
        self._clock = clock
        self._lock = threading.Lock()  # guards the maps below: step, writer and reader threads
        self._pending: dict[bytes, _QueuedWrite] = {}  # queued writes: a read serves these from memory
        self._pending_bytes = 0
        self.max_pending_bytes = max_pending_bytes  # past it, writes are dropped, not queued
        self._prefetched: OrderedDict[bytes, Future[bytearray]] = OrderedDict()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-store-write")
        self._readers = ThreadPoolExecutor(num_readers, thread_name_prefix="kv-store-read")
        self.writable = True  # False after a write's OSError: reads go on
        self.unwritable_reason = ""
        self.num_written_blocks = 0
        self.num_written_bytes = 0
        self.num_present_blocks = 0  # writes skipped: another worker had stored the block
        self.num_write_failures = 0
        self.num_dropped_writes = 0  # the write queue was full
        self.num_read_blocks = 0

    def path(self, block_hash: bytes) -> Path:
        return block_path(self.root, self.fingerprint, block_hash)

    def expectation(self, block_hash: bytes) -> Expectation:
        return Expectation(block_hash, self.fingerprint, self.layout, dtype_name(self.dtype))

    def retention_class(self, name: str) -> RetentionClass:
        """The class a save names; an unknown one falls back to the default rather than losing the block."""
        try:
            return self.policy.parse(name)
        except UnknownRetentionClass as e:
            log.debug("%s; storing as %r", e, self.policy.default.name)
            return self.policy.default

    # --- writes -----------------------------------------------------------------------------

    def write(self, block_hash: bytes, payload: memoryview, retention_class: str = "") -> bool:
        """Queue one block for the writer thread; False when skipped (writes off, already queued,
        or the queue is full: a disk slower than the saves must not grow memory, nor stall the
        step). ``payload`` must stay unchanged from now on: the caller hands over a private copy.

        A block already queued keeps its place, with the stronger of the two classes: its event
        reports that one. A block already on disk is not written again, but that is checked on the
        writer thread (a stat and a header), never remembered: kvcache may have collected it since.
        """
        if not self.writable:
            return False
        cls = self.retention_class(retention_class)
        with self._lock:
            queued = self._pending.get(block_hash)
            if queued is not None:
                queued.cls = self.policy.stronger(queued.cls, cls)
                return False
            if self._pending_bytes + payload.nbytes > self.max_pending_bytes:
                self.num_dropped_writes += 1
                return False
            queued = self._pending[block_hash] = _QueuedWrite(payload, cls)
            self._pending_bytes += payload.nbytes
        self._writer.submit(self._write, block_hash, queued)
        return True

    def _write(self, block_hash: bytes, queued: _QueuedWrite) -> None:
        stored = None
        try:
            if self.writable:
                stored = self._store(block_hash, queued.payload, queued.cls)
        except OSError as e:
            self.num_write_failures += 1
            self.stop_writing(f"{type(e).__name__}: {e}")
        except Exception:  # a bug here must not kill the writer thread and every later write
            self.num_write_failures += 1
            log.exception("KV store write of %s failed", block_hash.hex()[:16])
        finally:
            # Leaving the queue and reading the final class are one step under the lock: a save
            # that raised the class before it is reported below; one after it queues a new write,
            # which finds the file present and reports its own claim.
            with self._lock:
                del self._pending[block_hash]
                self._pending_bytes -= queued.payload.nbytes
                cls = queued.cls
        if stored is not None and self.on_stored is not None:
            header, claimed_at = stored
            try:
                self.on_stored(block_hash, self._claim(header, cls, claimed_at))
            except Exception:  # the event is lost, not the writer thread
                log.exception("KV store event of %s failed", block_hash.hex()[:16])

    def _store(
        self, block_hash: bytes, payload: memoryview, cls: RetentionClass
    ) -> tuple[BlockFileHeader, float]:
        """The header of the block's file and when this save claims it: the file already there
        (another worker, or an earlier save of this one, stored it) now, else the one written with
        ``cls`` as of its ``stored_at`` (so the claim is that header's own, unless a save raised
        the class meanwhile)."""
        path = self.path(block_hash)
        header = self._present(path, block_hash)
        if header is not None:
            self.num_present_blocks += 1
            return header, self._clock()
        now = self._clock()
        meta = BlockMeta(
            block_hash,
            self.fingerprint,
            self.layout,
            dtype_name(self.dtype),
            cls.name,
            stored_at=now,
            expires_at=cls.expires_at(now),
        )
        header = self._write_file(path, meta, payload, fsync=self.fsync)
        self.num_written_blocks += 1
        self.num_written_bytes += header.file_size
        return header, now

    def _claim(self, header: BlockFileHeader, cls: RetentionClass, now: float) -> StoredBlock:
        """The claim a save of class ``cls`` makes on the block in ``header``'s file: the stronger
        class and the later expiry of the two. The file is not rewritten to say so: the kvcache
        index keeps the stronger class from this event, while a rebuild of the index by a scan of
        the store sees the header's class (the block is as safe as its writer asked, no less)."""
        meta = header.meta
        expires_at = max(meta.expires_at, cls.expires_at(now))
        # A class this worker's config does not name (another config wrote the file): report
        # ours; the index, which merges every claim on a block, keeps the stronger anyway.
        with contextlib.suppress(UnknownRetentionClass):
            cls = self.policy.stronger(self.policy.get(meta.retention_class), cls)
        return StoredBlock(header, cls.name, expires_at)

    def _present(self, path: Path, block_hash: bytes) -> BlockFileHeader | None:
        """The header of a sound-looking file for this block already at ``path`` (another worker
        stored it), or None: then it is (over)written."""
        if not path.is_file():
            return None
        try:
            header = read_header(path)
        except BlockFileError:
            return None
        meta = header.meta
        expected = self.expectation(block_hash)
        ours = (meta.block_hash, meta.fingerprint, meta.layout, meta.dtype) == (
            expected.block_hash,
            expected.fingerprint,
            expected.layout,
            expected.dtype,
        )
        return header if ours and header.payload_len == self.block_num_bytes else None

    def stop_writing(self, why: str) -> None:
        """Turn writes off for good (one warning); reads go on."""
        with self._lock:
            if not self.writable:
                return
            self.writable = False
            self.unwritable_reason = why
        log.warning("KV store %s unwritable: %s; serving on without G3 writes", self.root, why)

    def flush(self) -> None:
        """Wait until every write queued so far is done (tests, shutdown)."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the queued writes, drop pending reads and wait out the running ones (no read
        of a closed store logs or touches files after it)."""
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True, cancel_futures=True)

    # --- reads ------------------------------------------------------------------------------

    def prefetch(self, block_hashes: Iterable[bytes]) -> None:
        """Start reading these blocks on the reader threads; ``read`` joins them."""
        with self._lock:
            for block_hash in block_hashes:
                if block_hash in self._prefetched or block_hash in self._pending:
                    continue
                self._prefetched[block_hash] = self._readers.submit(self._read, block_hash)
            while len(self._prefetched) > _MAX_PREFETCHED:
                self._prefetched.popitem(last=False)[1].cancel()

    def discard_prefetch(self, block_hash: bytes) -> None:
        """Forget a prefetch no load will join (the block came from G2, or an earlier one failed)."""
        with self._lock:
            future = self._prefetched.pop(block_hash, None)
        if future is not None:
            future.cancel()

    def read(self, block_hash: bytes) -> bytearray:
        """The block's payload (``block_num_bytes``), joining its prefetch if there is one. Raises
        ``BlockFileError`` for a block that is missing or unsound (a bad file is already deleted)."""
        with self._lock:
            future = self._prefetched.pop(block_hash, None)
            pending = self._pending.get(block_hash)
        if pending is not None:  # queued here, maybe not on disk yet: read our own write
            return bytearray(pending.payload)
        joined = future is not None and not future.cancelled()
        payload = future.result() if future is not None and joined else self._read(block_hash)
        self.num_read_blocks += 1
        return payload

    def _read(self, block_hash: bytes) -> bytearray:
        path = self.path(block_hash)
        try:
            payload = read_block_file(path, self.expectation(block_hash))
            if len(payload) != self.block_num_bytes:  # a consistent file of another packing
                detail = f"payload of {len(payload)} bytes, the layout makes {self.block_num_bytes}"
                raise BlockFileError(path, BlockFileFault.CORRUPT_HEADER, detail)
        except BlockFileError as e:
            self._drop(e)
            raise
        try:
            touch_block_file(path, self._clock())  # mtime = last use, for GC after a rebuild
        except OSError as e:
            log.debug("could not touch %s: %s", path, e)
        return payload  # writable: torch.frombuffer shares it without a warning

    def _drop(self, error: BlockFileError) -> None:
        if error.reason is BlockFileFault.MISSING:
            log.debug("KV block not in the store: %s", error.path)
            return
        if error.reason is BlockFileFault.UNREADABLE:
            # an I/O error may pass (EIO on a network mount): the file may well be sound, keep it
            log.warning("KV block unreadable, recomputing it: %s", error)
            return
        log.warning("KV block rejected, deleting it: %s", error)
        try:
            error.path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not delete %s: %s", error.path, e)
