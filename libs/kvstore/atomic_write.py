"""Writing a file whole or not at all, for stores that other processes and hosts read meanwhile."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomic(path: Path, data: bytes | memoryview, temp_prefix: str = "") -> None:
    """Write ``path`` through a temp file beside it, then a rename: a reader (on another host too,
    over NFS or 3FS) sees the old file, the whole new one, or none. The temp file is named
    ``<temp_prefix>.<random>.tmp`` (default prefix: "." + the name, hidden from scans)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f"{temp_prefix or '.' + path.name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(temp, "xb") as f:
            f.write(data)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
