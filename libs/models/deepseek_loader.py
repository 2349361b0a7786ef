"""DeepSeek-V3-family checkpoints: HF on-disk tensor names <-> DeepseekV3ForCausalLM's state dict.

On disk (DeepSeek's release, and transformers' save_pretrained): ``model.layers.N...`` with one
tensor per expert (``mlp.experts.E.{gate,up,down}_proj.weight``) and separate gate/up projections;
the MTP modules are layers ``num_hidden_layers + k`` (``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm``, the decoder block's own names, and copies of the embedding and head that
are the main model's and are not kept). In memory the experts are packed [E, 2I, H] / [E, H, I]
and every gate/up pair is one projection, rows [gate | up].
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from libs.modelfiles.deepseek_config import DeepseekV3Config
from libs.models.deepseek_v3 import DeepseekV3ForCausalLM
from libs.models.fp8 import quantize_fp8_block
from libs.models.hf_checkpoint import (
    INDEX_FILE,
    CheckpointError,
    check_state,
    read_checkpoint,
    read_hf_config,
)

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"(.*mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
_GATE_UP = re.compile(r"(.*(?:mlp|shared_experts))\.(gate|up)_proj\.weight")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.")
_MTP_COPIES = ("embed_tokens.", "shared_head.head.")  # the main model's tensors, stored again
# Kept in float32 in every model dtype (transformers does the same): routing is precision-sensitive.
_FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def _our_name(disk_name: str, config: DeepseekV3Config) -> str | None:
    """Our state-dict name of an on-disk tensor (gate/up and experts still split), or None to skip."""
    name = disk_name.removeprefix("model.")
    match = _LAYER.fullmatch(name)
    if match is None or int(match[1]) < config.num_hidden_layers:
        return name
    k, rest = int(match[1]) - config.num_hidden_layers, match[2]
    if k >= config.num_nextn_predict_layers or rest.startswith(_MTP_COPIES):
        return None  # an MTP module not asked for (or past the config's), or a copy of ours
    if rest.startswith(_MTP_OWN):
        return f"mtp.{k}.{rest}"
    if rest.startswith("shared_head.norm."):
        return f"mtp.{k}.shared_head_norm.{rest.removeprefix('shared_head.norm.')}"
    return f"mtp.{k}.block.{rest}"


def _pack(tensors: dict[str, Tensor], config: DeepseekV3Config) -> dict[str, Tensor]:
    """Experts stacked and gate/up concatenated, as the model holds them."""
    out: dict[str, Tensor] = {}
    experts: dict[str, dict[str, dict[int, Tensor]]] = {}
    pairs: dict[str, dict[str, Tensor]] = {}
    for name, tensor in tensors.items():
        if (m := _EXPERT.fullmatch(name)) is not None:
            experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = tensor
        elif (m := _GATE_UP.fullmatch(name)) is not None:
            pairs.setdefault(m[1], {})[m[2]] = tensor
        else:
            out[name] = tensor
    for prefix, parts in pairs.items():
        if parts.keys() != {"gate", "up"}:
            raise CheckpointError(f"{prefix}: has {sorted(parts)} of gate_proj/up_proj")
        _same_shapes(f"{prefix}.{{gate,up}}_proj.weight", [parts["gate"], parts["up"]])
        out[f"{prefix}.gate_up_proj.weight"] = torch.cat([parts["gate"], parts["up"]])
    for prefix, kinds in experts.items():
        for kind, by_id in kinds.items():
            if sorted(by_id) != list(range(config.n_routed_experts)):
                raise CheckpointError(
                    f"{prefix}: {kind}_proj of experts {sorted(by_id)}, "
                    f"expected 0..{config.n_routed_experts - 1}"
                )
        if kinds.keys() != {"gate", "up", "down"}:
            raise CheckpointError(f"{prefix}: has {sorted(kinds)} of gate/up/down_proj")
        ids = range(config.n_routed_experts)
        _same_shapes(
            f"{prefix}.*.{{gate,up}}_proj.weight", [kinds[k][e] for k in ("gate", "up") for e in ids]
        )
        _same_shapes(f"{prefix}.*.down_proj.weight", [kinds["down"][e] for e in ids])
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([kinds["gate"][e], kinds["up"][e]]) for e in ids]
        )
        out[f"{prefix}.down_proj"] = torch.stack([kinds["down"][e] for e in ids])
    return out


def _same_shapes(what: str, tensors: list[Tensor]) -> None:
    """Parts packed into one tensor must agree (their packed shape is checked against the config)."""
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1:
        raise CheckpointError(f"{what}: the parts differ in shape {sorted(shapes)}")


def load_deepseek_v3(
    directory: Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    with_mtp: bool = True,
) -> DeepseekV3ForCausalLM:
    """A ready-to-run model (eval, no grad) from an HF checkpoint directory; CheckpointError when
    the checkpoint does not fit the config (missing, unexpected or misshapen tensors, by name).
    ``with_mtp=False`` skips the MTP modules (V3's is 11.5B parameters) where nothing drafts."""
    directory = Path(directory)
    config = config_of(directory)
    if not with_mtp:
        config = dataclasses.replace(config, num_nextn_predict_layers=0)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config, dtype=dtype)
    expected = model.state_dict()
    # The whole checkpoint is checked from its headers first: a bad one reads no weights.
    check_state(directory, _state_dict(directory, config, dtype, meta=True), expected)
    state = _state_dict(directory, config, dtype, meta=False)
    check_state(directory, state, expected)
    model.load_state_dict({n: t.to(device) for n, t in state.items()}, strict=True, assign=True)
    model.reset_rope_cache(device)
    model.eval()
    model.requires_grad_(False)
    return model


def _state_dict(
    directory: Path, config: DeepseekV3Config, dtype: torch.dtype, *, meta: bool
) -> dict[str, Tensor]:
    """The checkpoint under our names, packed (meta tensors when ``meta``)."""
    renamed: dict[str, Tensor] = {}
    for disk_name, tensor in read_checkpoint(directory, dtype, _FP32_SUFFIXES, meta=meta).items():
        name = _our_name(disk_name, config)
        if name is not None:
            renamed[name] = tensor
    try:
        state = _pack(renamed, config)
    except CheckpointError as e:
        raise CheckpointError(f"{directory}: {e}") from None
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def config_of(directory: Path) -> DeepseekV3Config:
    try:
        return DeepseekV3Config.from_hf_config(read_hf_config(directory))
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{Path(directory) / 'config.json'}: {e}") from None


# --- writing: the tiny random checkpoints of tests and benches ---------------------------------


def disk_state_dict(model: DeepseekV3ForCausalLM) -> dict[str, Tensor]:
    """The model's tensors under their on-disk names and layout (the inverse of the loader)."""
    config = model.config
    out: dict[str, Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("mtp."):
            _, index, rest = name.split(".", 2)
            layer = f"model.layers.{config.num_hidden_layers + int(index)}"
            rest = rest.removeprefix("block.").replace("shared_head_norm.", "shared_head.norm.")
            name = f"{layer}.{rest}"
        elif name != "lm_head.weight":
            name = f"model.{name}"
        _unpack_into(out, name, tensor.detach().contiguous())
    for k in range(config.num_nextn_predict_layers):
        mtp_layer = f"model.layers.{config.num_hidden_layers + k}"
        out[f"{mtp_layer}.embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        head = out.get("lm_head.weight", out["model.embed_tokens.weight"])
        out[f"{mtp_layer}.shared_head.head.weight"] = head.clone()
    return out


def _unpack_into(out: dict[str, Tensor], name: str, tensor: Tensor) -> None:
    if name.endswith("experts.gate_up_proj"):
        prefix = name.removesuffix(".gate_up_proj")
        for e, packed in enumerate(tensor):
            gate, up = packed.chunk(2)
            out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = (
                gate.clone(),
                up.clone(),
            )
    elif name.endswith("experts.down_proj"):
        prefix = name.removesuffix(".down_proj")
        for e, down in enumerate(tensor):
            out[f"{prefix}.{e}.down_proj.weight"] = down.clone()
    elif name.endswith("gate_up_proj.weight"):
        prefix = name.removesuffix(".gate_up_proj.weight")
        gate, up = tensor.chunk(2)
        out[f"{prefix}.gate_proj.weight"], out[f"{prefix}.up_proj.weight"] = gate.clone(), up.clone()
    else:
        out[name] = tensor


def write_checkpoint(
    model: DeepseekV3ForCausalLM,
    directory: Path,
    config_json: dict[str, object],
    *,
    num_shards: int = 1,
    fp8_block: tuple[int, int] | None = None,
) -> None:
    """``directory``/config.json and the safetensors (sharded with an index when num_shards > 1);
    with ``fp8_block``, every 2-D projection weight FP8 with its block scales, as V3 ships."""
    import json

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = disk_state_dict(model)
    if fp8_block is not None:
        config_json = {
            **config_json,
            "quantization_config": {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": list(fp8_block),
            },
        }
        for name in [n for n in tensors if _quantized_on_disk(n, tensors[n])]:
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_block(tensors[name], fp8_block)
    (directory / "config.json").write_text(json.dumps(config_json, indent=2))
    names = sorted(tensors)
    if num_shards <= 1:
        save_file({n: tensors[n] for n in names}, str(directory / "model.safetensors"))
        return
    weight_map: dict[str, str] = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = names[i::num_shards]
        save_file({n: tensors[n] for n in shard}, str(directory / file))
        weight_map.update(dict.fromkeys(shard, file))
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def _quantized_on_disk(name: str, tensor: Tensor) -> bool:
    """V3 keeps embeddings, the head, norms and the router gate unquantized."""
    if tensor.dim() != 2 or name.endswith(
        ("embed_tokens.weight", "lm_head.weight", "head.weight", "mlp.gate.weight")
    ):
        return False
    return name.endswith("_proj.weight") or name.endswith("_mqa.weight")
