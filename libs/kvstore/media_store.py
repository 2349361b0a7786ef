"""The media store: images and their encoder outputs as files on the shared store, by content hash.

A gateway writes an image file's bytes under their sha256; an encoder reads them, writes the
vision tower's output for that model under the same hash, and removes the image; a worker reads
the output when a prefill chunk reaches the image's tokens. Images and embeddings can be far
larger than a NATS message: only their hashes travel on the bus.

    <root>/images/<hh>/<hash hex>                        the image file, as the client sent it
    <root>/embeds/<model fingerprint>/<hh>/<hash hex>    its encoder output (safetensors bytes)

Every write goes to a temporary name in the same directory first, then ``os.replace``: a reader on
another host (NFS, 3FS) sees a whole file or none. Temp names start with "." and end with ".tmp".
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from libs.kvstore.atomic_write import write_atomic

MM_HASH_NUM_BYTES: Final = 32
EMBEDS_TENSOR: Final = "embeds"  # the one tensor of an encoder output file, [num_tokens, hidden]
_FINGERPRINT: Final = re.compile(r"[0-9A-Za-z_.-]{1,64}")


def image_hash(data: bytes) -> bytes:
    """The content hash of an image file: sha256 of its bytes (equal files, equal hashes)."""
    return hashlib.sha256(data).digest()


def _hex(mm_hash: bytes) -> str:
    if len(mm_hash) != MM_HASH_NUM_BYTES:
        raise ValueError(f"an image hash has {MM_HASH_NUM_BYTES} bytes, not {len(mm_hash)}")
    return mm_hash.hex()


class MediaStore:
    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def image_path(self, mm_hash: bytes) -> Path:
        name = _hex(mm_hash)
        return self.root / "images" / name[:2] / name

    def embeds_path(self, fingerprint: str, mm_hash: bytes) -> Path:
        if not _FINGERPRINT.fullmatch(fingerprint):
            raise ValueError(f"not a model fingerprint: {fingerprint!r}")
        name = _hex(mm_hash)
        return self.root / "embeds" / fingerprint / name[:2] / name

    def put_image(self, mm_hash: bytes, data: bytes) -> None:
        """Store an image's bytes (already there from an earlier request: nothing to write)."""
        path = self.image_path(mm_hash)
        if not path.is_file():
            write_atomic(path, data)

    def read_image(self, mm_hash: bytes) -> bytes:
        """FileNotFoundError when it is not (or no longer) stored."""
        return self.image_path(mm_hash).read_bytes()

    def remove_image(self, mm_hash: bytes) -> None:
        self.image_path(mm_hash).unlink(missing_ok=True)

    def put_embeds(self, fingerprint: str, mm_hash: bytes, data: bytes) -> None:
        write_atomic(self.embeds_path(fingerprint, mm_hash), data)

    def has_embeds(self, fingerprint: str, mm_hash: bytes) -> bool:
        return self.embeds_path(fingerprint, mm_hash).is_file()

    def embeds_used_at(self, fingerprint: str, mm_hash: bytes) -> float | None:
        """When an output was last written or used (its file's mtime: every encoder touches it on a
        hit), or None when it is gone."""
        try:
            return self.embeds_path(fingerprint, mm_hash).stat().st_mtime
        except FileNotFoundError:
            return None

    def touch_embeds(self, fingerprint: str, mm_hash: bytes, now: float) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.embeds_path(fingerprint, mm_hash), (now, now))

    def remove_stale_images(self, older_than: float) -> int:
        """Remove image files (and temp files) last written before ``older_than``: those of requests
        that never reached an encoder (a gateway died, a client left). How many went."""
        removed = 0
        for path in (self.root / "images").glob("*/*"):
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_mtime < older_than:
                    path.unlink()
                    removed += 1
        return removed

    def read_embeds(self, fingerprint: str, mm_hash: bytes) -> bytes:
        """FileNotFoundError when the encoder cache no longer holds it."""
        return self.embeds_path(fingerprint, mm_hash).read_bytes()

    def remove_embeds(self, fingerprint: str, mm_hash: bytes) -> None:
        self.embeds_path(fingerprint, mm_hash).unlink(missing_ok=True)

    def stored_embeds(self, fingerprint: str) -> Iterator[tuple[bytes, float, int]]:
        """(hash, mtime, size) of every stored output of that model (temp files skipped)."""
        directory = self.embeds_path(fingerprint, bytes(MM_HASH_NUM_BYTES)).parent.parent
        if not directory.is_dir():
            return
        for sub in directory.iterdir():
            for path in sub.iterdir() if sub.is_dir() else ():
                if path.name.startswith(".") or len(path.name) != 2 * MM_HASH_NUM_BYTES:
                    continue
                try:
                    stat = path.stat()
                    yield bytes.fromhex(path.name), stat.st_mtime, stat.st_size
                except (OSError, ValueError):
                    continue  # removed meanwhile, or not one of ours
