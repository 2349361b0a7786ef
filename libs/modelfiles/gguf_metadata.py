"""Fast, torch-free reader of a GGUF file's header: key/value metadata and tensor names.

gguf.GGUFReader builds numpy views for every element of every metadata array (about 3 s for a
49k-token vocabulary); this walks the same bytes with struct and skips the arrays nobody asked
for, so a gateway can read a model's config or tokenizer without paying that or importing torch.
Layout (GGUF v2/v3, little-endian): magic, version u32, tensor_count u64, kv_count u64, then
kv_count (key, type u32, value) and tensor_count (name, n_dims u32, dims u64[n], type u32, offset u64).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from libs.modelfiles.llama_config import LlamaConfig

_MAGIC: Final = b"GGUF"
_STRING: Final = 8
_ARRAY: Final = 9
# GGUF value type -> struct format of one scalar.
_SCALARS: Final = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    metadata: dict[str, Any]  # arrays not asked for in full hold their length (an int) instead
    tensor_names: tuple[str, ...]


class _Cursor:
    def __init__(self, buffer: mmap.mmap, name: str) -> None:
        self.buffer, self.name, self.offset = buffer, name, 0

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        except struct.error as exc:
            raise ValueError(f"{self.name}: truncated GGUF header") from exc
        self.offset += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        length = self.unpack("Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise ValueError(f"{self.name}: truncated GGUF header")
        text = self.buffer[self.offset : end].decode("utf-8", errors="replace")
        self.offset = end
        return text

    def skip_string(self) -> None:
        self.offset += 8 + self.unpack("Q")

    def value(self, value_type: int, keep: bool) -> Any:
        if value_type == _STRING:
            if keep:
                return self.string()
            self.skip_string()
            return None
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])
        if value_type != _ARRAY:
            raise ValueError(f"{self.name}: unknown GGUF value type {value_type}")
        item_type, count = self.unpack("I"), self.unpack("Q")
        if item_type in _SCALARS:
            fmt = f"<{count}{_SCALARS[item_type]}"
            end = self.offset + struct.calcsize(fmt)
            if end > len(self.buffer):
                raise ValueError(f"{self.name}: truncated GGUF header")
            values = struct.unpack_from(fmt, self.buffer, self.offset) if keep else ()
            self.offset = end
            return list(values) if keep else count
        if keep:
            return [self.value(item_type, keep=True) for _ in range(count)]
        for _ in range(count):  # strings or nested arrays: walk them to find the end
            self.value(item_type, keep=False)
        return count


def read_gguf_header(path: Path, full_arrays: Collection[str] = ()) -> GGUFHeader:
    """Metadata and tensor names of a GGUF; only arrays named in full_arrays are decoded."""
    path = Path(path)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        cursor = _Cursor(buffer, path.name)
        if buffer[:4] != _MAGIC:
            raise ValueError(f"{path.name}: not a GGUF file")
        cursor.offset = 4
        version = cursor.unpack("I")
        if version not in (2, 3):
            raise ValueError(f"{path.name}: unsupported GGUF version {version} (2 and 3 are)")
        tensor_count, kv_count = cursor.unpack("Q"), cursor.unpack("Q")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            value_type = cursor.unpack("I")
            # Scalars and strings are always kept; arrays only when asked for.
            metadata[key] = cursor.value(value_type, keep=value_type != _ARRAY or key in full_arrays)
        names = []
        for _ in range(tensor_count):
            names.append(cursor.string())
            n_dims = cursor.unpack("I")
            cursor.offset += 8 * n_dims + 4 + 8  # dims, ggml type, data offset
    return GGUFHeader(metadata, tuple(names))


def read_gguf_config(path: Path) -> LlamaConfig:
    """The LlamaConfig a GGUF file describes (header only: milliseconds, no torch)."""
    header = read_gguf_header(path)
    tied = "output.weight" not in header.tensor_names
    return LlamaConfig.from_gguf_metadata(header.metadata, tie_word_embeddings=tied)


def read_gguf_architecture(path: Path) -> str:
    """``general.architecture`` ("llama" for every model this reader serves today)."""
    architecture = read_gguf_header(path).metadata.get("general.architecture")
    if not isinstance(architecture, str):
        raise ValueError(f"{path}: the GGUF has no general.architecture")
    return architecture
