"""Load a llama-family GGUF into LlamaForCausalLM, caching the dequantized weights as safetensors.

Opening and dequantizing a GGUF takes seconds; the converted fp32 state dict is written once per
file content (keyed by the model fingerprint) into a caller-given cache dir, atomically (tmp +
rename), so a restart or a second process loads it in well under two seconds.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Final

import gguf
import numpy as np
import safetensors
import safetensors.torch
import torch
from torch import Tensor

from libs.modelfiles.gguf_metadata import read_gguf_config
from libs.modelfiles.llama_config import LlamaConfig
from libs.modelfiles.registry import model_fingerprint
from libs.models.llama import LlamaForCausalLM

__all__ = ["cached_weights_path", "convert_gguf", "load_llama", "load_state_dict_cached", "read_gguf_config"]

logger = logging.getLogger(__name__)

# Bump when the stored layout (names, fusion, dtype) changes: old cache files are then ignored.
_CACHE_FORMAT: Final = "deepinfer-llama-fp32-v1"
_PER_LAYER: Final = {
    "attn_norm": "input_layernorm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL: Final = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def load_llama(
    path: Path, cache_dir: Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> LlamaForCausalLM:
    """A ready-to-run model (eval mode, no grad) from a GGUF, converting it once into cache_dir."""
    config, state_dict = load_state_dict_cached(Path(path), Path(cache_dir))
    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype=dtype)
    state_dict = {name: tensor.to(device=device, dtype=dtype) for name, tensor in state_dict.items()}
    model.load_state_dict(state_dict, strict=True, assign=True)
    model.reset_rope_cache(device)
    model.eval()
    model.requires_grad_(False)
    return model


def cached_weights_path(path: Path, cache_dir: Path) -> Path:
    return Path(cache_dir) / f"{Path(path).stem}-{model_fingerprint(Path(path))}.safetensors"


def load_state_dict_cached(path: Path, cache_dir: Path) -> tuple[LlamaConfig, dict[str, Tensor]]:
    """(config, fp32 model state dict) from the cache, converting and storing it on a miss."""
    cache_file = cached_weights_path(path, cache_dir)
    cached = _read_cache(cache_file)
    if cached is not None:
        return cached
    config, state_dict = convert_gguf(path)
    _write_cache(cache_file, config, state_dict)
    return config, state_dict


def convert_gguf(path: Path) -> tuple[LlamaConfig, dict[str, Tensor]]:
    """Dequantize every tensor of a llama GGUF to fp32 and map it onto LlamaForCausalLM's names."""
    started = time.monotonic()
    config = read_gguf_config(path)
    reader = gguf.GGUFReader(path)
    total = len(reader.tensors)
    logger.info("converting %s: %d tensors (one-time; cached afterwards)", Path(path).name, total)
    raw: dict[str, Tensor] = {}
    for count, tensor in enumerate(reader.tensors, start=1):
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(dim) for dim in reversed(tensor.shape))  # GGUF lists dims innermost first
        raw[tensor.name] = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
        if count % 30 == 0 or count == total:
            logger.info("converting %s: %d/%d tensors", Path(path).name, count, total)
    state_dict = _rename(raw, config)
    logger.info("converted %s in %.1f s", Path(path).name, time.monotonic() - started)
    return config, state_dict


def _rename(raw: dict[str, Tensor], config: LlamaConfig) -> dict[str, Tensor]:
    """GGUF tensor names -> model state dict, fusing q/k/v and gate/up. Unknown tensors are an error."""
    state_dict: dict[str, Tensor] = {}
    for i in range(config.num_hidden_layers):
        blk, layer = f"blk.{i}", f"layers.{i}"
        q, k, v = (raw.pop(f"{blk}.attn_{x}.weight") for x in ("q", "k", "v"))
        # Kept in GGUF (ggml rope) row order: the model's rotary rotates interleaved pairs.
        state_dict[f"{layer}.self_attn.qkv_proj.weight"] = torch.cat([q, k, v])
        gate, up = raw.pop(f"{blk}.ffn_gate.weight"), raw.pop(f"{blk}.ffn_up.weight")
        state_dict[f"{layer}.mlp.gate_up_proj.weight"] = torch.cat([gate, up])
        for src, dst in _PER_LAYER.items():
            state_dict[f"{layer}.{dst}.weight"] = raw.pop(f"{blk}.{src}.weight")
    for src, dst in _GLOBAL.items():
        if f"{src}.weight" in raw:
            state_dict[f"{dst}.weight"] = raw.pop(f"{src}.weight")
    if raw:
        raise ValueError(f"GGUF has tensors this llama model does not use: {sorted(raw)[:8]}")
    return state_dict


def _read_cache(cache_file: Path) -> tuple[LlamaConfig, dict[str, Tensor]] | None:
    if not cache_file.is_file():
        return None
    try:
        with safetensors.safe_open(str(cache_file), framework="pt") as f:
            metadata = f.metadata() or {}
        if metadata.get("format") != _CACHE_FORMAT:
            return None
        config = LlamaConfig.from_dict(json.loads(metadata["config"]))
        state_dict = safetensors.torch.load_file(str(cache_file))
    except (OSError, ValueError, KeyError, safetensors.SafetensorError) as exc:
        logger.warning("ignoring unreadable weight cache %s: %s", cache_file, exc)
        return None
    return config, state_dict


def _write_cache(cache_file: Path, config: LlamaConfig, state_dict: dict[str, Tensor]) -> None:
    """Write to a private temp file in the same dir, then rename: readers never see a partial file."""
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=cache_file.parent, prefix=f".{cache_file.name}.", suffix=".tmp")
    os.close(fd)
    try:
        metadata = {"format": _CACHE_FORMAT, "config": json.dumps(config.to_dict())}
        safetensors.torch.save_file(state_dict, tmp_name, metadata=metadata)
        os.chmod(tmp_name, 0o644)  # mkstemp makes it 0600; other workers may read the cache
        os.replace(tmp_name, cache_file)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    logger.info("cached converted weights at %s", cache_file)
