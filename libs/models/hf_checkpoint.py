"""An HF checkpoint directory: config.json, and its safetensors (one file, or shards with an index).

``read_checkpoint`` returns every tensor by its on-disk name, FP8 block-quantized weights already
dequantized (``fp8.py``), in the dtype asked for. Anything wrong is a ``CheckpointError`` naming the
file and the field or tensor, raised before a model is built: nothing half-loads. With
``meta=True`` it reads only the safetensors headers and returns meta tensors of the same shapes and
dtypes, so a loader can check a checkpoint whole before reading a byte of weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from libs.models.fp8 import check_block_scales, dequantize_fp8_block

INDEX_FILE: Final = "model.safetensors.index.json"
SINGLE_FILE: Final = "model.safetensors"
_FLOAT_DTYPES: Final = (torch.float32, torch.float16, torch.bfloat16)
_SCALE_SUFFIX: Final = "_scale_inv"
# safetensors' dtype names -> torch's; anything else reads as int8, which is refused by name.
_SAFETENSORS_DTYPES: Final = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be served; the message names the file and the field or tensor."""


def read_hf_config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json in the checkpoint directory") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return data


def shard_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it, from the index (every shard must exist) or the one file."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: no readable weight_map ({e})") from None
        files = {name: directory / file for name, file in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise CheckpointError(f"{index}: names shard {path.name}, which is missing")
        return files
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"{directory}: neither {INDEX_FILE} nor {SINGLE_FILE}")
    with _open(single) as f:
        return dict.fromkeys(f.keys(), single)


def _open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def fp8_block_size(config: dict[str, Any], config_path: Path) -> tuple[int, int] | None:
    """V3's ``quantization_config`` block (128, 128), None for an unquantized checkpoint."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(
            f"{config_path}: quantization_config {quant.get('quant_method')!r}/{quant.get('fmt')!r} is not "
            "supported (fp8 e4m3 with block scales)"
        )
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(
            f"{config_path}: quantization_config.weight_block_size {block!r}: expected [rows, cols]"
        )
    return block[0], block[1]


def read_checkpoint(
    directory: Path, dtype: torch.dtype, keep_fp32: tuple[str, ...] = (), *, meta: bool = False
) -> dict[str, Tensor]:
    """Every tensor of the checkpoint by name, in ``dtype`` (names ending in one of ``keep_fp32``
    in float32);
    FP8 weights dequantized with their ``weight_scale_inv`` (which are not returned). ``meta``:
    shapes and dtypes from the headers only (meta tensors), for checking before loading."""
    directory = Path(directory)
    block = fp8_block_size(read_hf_config(directory), directory / "config.json")
    files = shard_files(directory)
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    raw: dict[str, Tensor] = {}
    where: dict[str, Path] = {}
    for path, names in by_file.items():
        with _open(path) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"{path}: the index places tensor {name!r} here, but it is absent")
                raw[name], where[name] = _header_tensor(f, name) if meta else f.get_tensor(name), path
    out: dict[str, Tensor] = {}
    for name, tensor in raw.items():
        if name.endswith(_SCALE_SUFFIX):
            if name.removesuffix(_SCALE_SUFFIX) not in raw:
                raise CheckpointError(f"{where[name]}: {name!r} scales no tensor")
            continue
        target = torch.float32 if name.endswith(keep_fp32) else dtype
        if tensor.dtype == torch.float8_e4m3fn:
            out[name] = _dequantize(name, tensor, raw, where[name], block, target)
        elif tensor.dtype in _FLOAT_DTYPES:
            out[name] = tensor.to(target)
        else:
            raise CheckpointError(
                f"{where[name]}: tensor {name!r} has dtype {tensor.dtype}, not a float format"
            )
    return out


def _header_tensor(f: Any, name: str) -> Tensor:
    """A meta tensor of the stored tensor's shape and dtype (read from the header alone)."""
    stored = f.get_slice(name)
    dtype = _SAFETENSORS_DTYPES.get(stored.get_dtype(), torch.int8)
    return torch.empty(stored.get_shape(), dtype=dtype, device="meta")


def _dequantize(
    name: str,
    weight: Tensor,
    raw: dict[str, Tensor],
    path: Path,
    block: tuple[int, int] | None,
    dtype: torch.dtype,
) -> Tensor:
    scale = raw.get(name + _SCALE_SUFFIX)
    if block is None:
        raise CheckpointError(f"{path}: {name!r} is float8 but config.json has no quantization_config")
    if scale is None:
        raise CheckpointError(f"{path}: {name!r} is float8 without {name + _SCALE_SUFFIX!r}")
    why = check_block_scales(tuple(weight.shape), tuple(scale.shape), block)
    if why is not None:
        raise CheckpointError(f"{path}: {name!r}: {why}")
    return dequantize_fp8_block(weight, scale, block, dtype)


def check_state(directory: Path, state: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    """CheckpointError unless ``state`` has exactly ``expected``'s names and shapes (a model's
    state dict, on the meta device or not)."""
    missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
    if missing or unexpected:
        raise CheckpointError(
            f"{directory}: tensors missing {sorted(missing)[:5]} ({len(missing)}), "
            f"unexpected {sorted(unexpected)[:5]} ({len(unexpected)})"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"{directory}: {name}: shape {list(tensor.shape)}, config says {list(expected[name].shape)}"
            )
