"""The handoff area: P/D handoffs' partial last prompt blocks, one file each, outside the tiers.

A partial block has no chained hash, so it must never enter G1, G2 or G3; it lives here from the
prefill worker's save to the decode worker's load, then it is deleted:

    <root>/<fingerprint>/<key hex>.kvb    one page (the block file format), key unique per handoff

The root is a directory both workers see: by default ``<store>/.handoff`` (kvcache's scans skip
dot directories, so no index ever names these files), or host shared memory (``/dev/shm/..``)
when both share a machine. Each file holds the whole page; only the slots before the sequence's
computed tokens are ever read by attention.

Writes and deletions run in order on one thread, off the step path: a deletion asked for after a
write (a cancel during the handoff) comes after it. ``on_done`` hears of each write once it is
finished, failed ones too (the decode worker then finds no file and recomputes the block): those
are the notices the scheduler waits for. Reads run on the step thread and delete what they read.
A file nobody loads or drops (its scheduler died, a notice was lost) is collected by ``sweep``
once older than ``max_age_s``: any worker's sweep may collect any file, the area being shared.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from libs.kvstore.block_file import (
    BLOCK_FILE_SUFFIX,
    BlockFileError,
    BlockLayout,
    BlockMeta,
    Expectation,
    read_block_file,
    write_block_file,
)
from libs.kvstore.block_hash import block_hash_hex
from services.worker.kv_store import dtype_name

log = logging.getLogger(__name__)

HANDOFF_DIR_NAME = ".handoff"  # under the G3 store root, where no index looks
DEFAULT_MAX_AGE_S = 600.0  # a file this old is collected: every handoff is loaded long before


class HandoffArea:
    def __init__(
        self,
        root: Path | str,
        fingerprint: str,
        layout: BlockLayout,
        dtype: torch.dtype,
        *,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.dir = Path(root) / fingerprint
        self.fingerprint = fingerprint
        self.layout = layout
        self.dtype = dtype
        self.max_age_s = max_age_s
        self._clock = clock
        self.block_shape = layout.kv_spec.block_shape(layout.block_size)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-handoff")
        self._lock = threading.Lock()
        self._done: list[bytes] = []  # keys whose write finished (or failed), not yet drained
        self.on_done: Callable[[], None] | None = None  # from the writer thread, after each write
        self.num_written = 0
        self.num_write_failures = 0
        self.num_loaded = 0
        self.num_failed_loads = 0
        self.num_dropped = 0
        self.num_swept = 0

    def path(self, key: bytes) -> Path:
        return self.dir / f"{block_hash_hex(key)}{BLOCK_FILE_SUFFIX}"

    # --- the prefill side -------------------------------------------------------------------

    def write(self, key: bytes, payload: torch.Tensor) -> None:
        """Queue one page's file; ``payload`` is ``[*block_shape]`` on the host, a private copy."""
        self._writer.submit(self._write, key, payload)

    def skip(self, key: bytes) -> None:
        """A save that cannot be made (its KV was never written): noticed as done, no file."""
        self._writer.submit(self._noticed, key)

    def _write(self, key: bytes, payload: torch.Tensor) -> None:
        try:
            now = self._clock()
            meta = BlockMeta(key, self.fingerprint, self.layout, dtype_name(self.dtype), "", now, now)
            raw = payload.contiguous().view(torch.uint8).reshape(-1).numpy()  # no copy
            write_block_file(self.path(key), meta, raw.data)
            self.num_written += 1
        except Exception as exc:  # the decode worker recomputes the block; the notice still goes
            self.num_write_failures += 1
            log.warning("handoff write of %s failed: %r", block_hash_hex(key)[:16], exc)
        self._noticed(key)

    def _noticed(self, key: bytes) -> None:
        with self._lock:
            self._done.append(key)
        if self.on_done is not None:
            self.on_done()

    def drain_done(self) -> list[bytes]:
        with self._lock:
            done, self._done = self._done, []
        return done

    # --- the decode side --------------------------------------------------------------------

    def read(self, key: bytes) -> torch.Tensor | None:
        """The page saved under ``key`` as ``[*block_shape]``, its file deleted; None (counted) when
        there is none or it fails a check (a corrupt one is deleted too): then it is recomputed."""
        path = self.path(key)
        try:
            payload = read_block_file(
                path, Expectation(key, self.fingerprint, self.layout, dtype_name(self.dtype))
            )
            tensor = torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype).view(self.block_shape)
        except (BlockFileError, RuntimeError) as exc:
            self.num_failed_loads += 1
            log.warning("handoff block %s not loaded, recomputing it: %s", block_hash_hex(key)[:16], exc)
            tensor = None
        else:
            self.num_loaded += 1
        _unlink(path)
        return tensor

    def drop(self, keys: Iterable[bytes]) -> None:
        """Delete these files once the writes queued before are done (no plan will load them)."""
        paths = [self.path(k) for k in keys]
        if paths:
            self._writer.submit(self._drop, paths)

    def _drop(self, paths: list[Path]) -> None:
        for path in paths:
            self.num_dropped += _unlink(path)

    # --- collection -------------------------------------------------------------------------

    def sweep(self) -> int:
        """Delete this model's files (and dead writers' temp files) older than ``max_age_s``; returns
        how many. Blocking I/O: the service runs it in a thread."""
        cutoff = self._clock() - self.max_age_s
        num_deleted = 0
        try:
            entries = list(os.scandir(self.dir))
        except FileNotFoundError:
            return 0
        for entry in entries:
            try:
                old = entry.is_file() and entry.stat().st_mtime < cutoff
            except FileNotFoundError:
                continue
            if old:
                num_deleted += _unlink(Path(entry.path))
        self.num_swept += num_deleted
        return num_deleted

    def flush(self) -> None:
        """Wait for the queued writes and drops (tests, shutdown)."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._writer.shutdown(wait=True)


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("could not delete %s: %s", path, exc)
        return False
    return True
