"""LLaVA checkpoints: HF on-disk tensor names <-> our VisionTower's and LlamaForCausalLM's.

On disk (transformers 5's save_pretrained): ``model.vision_tower.{embeddings,pre_layrnorm,
encoder.layers.N,post_layernorm}.*``, ``model.multi_modal_projector.linear_{1,2}.*``,
``model.language_model.*`` and ``lm_head.weight``. Older writers put the same tensors under
``vision_tower.vision_model.*``, ``multi_modal_projector.*``, ``language_model.model.*`` and
``language_model.lm_head.weight`` (llava-hf's releases), or ``model.vision_tower.vision_model.*``
(transformers 4.5x): those names are read as the new ones.

In memory q/k/v are one projection (rows [q | k | v], biases too in the tower) and the decoder's
gate/up one (rows [gate | up]); the decoder's q and k rows are permuted from HF's rotate-half
order to the interleaved order our rotary rotates (what llama.cpp's converter does for GGUF).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final, TypeVar

import torch
from torch import Tensor, nn

from libs.modelfiles.llama_config import LlamaConfig
from libs.modelfiles.llava_config import LlavaConfig, read_llava_config
from libs.models.hf_checkpoint import CheckpointError, check_state, read_checkpoint
from libs.models.llama import LlamaForCausalLM
from libs.models.llava import VisionTower

VISION_PREFIX: Final = "model.vision_tower."
PROJECTOR_PREFIX: Final = "model.multi_modal_projector."
TEXT_PREFIX: Final = "model.language_model."
LM_HEAD: Final = "lm_head.weight"
# Older writers' prefixes -> transformers 5's, applied in order (the last one after the others).
_RENAMES: Final = (
    ("language_model.model.", TEXT_PREFIX),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.", VISION_PREFIX),
    ("multi_modal_projector.", PROJECTOR_PREFIX),
    (VISION_PREFIX + "vision_model.", VISION_PREFIX),
)
_ENCODER_LAYER = re.compile(r"encoder\.layers\.(\d+)\.(.+)")
_VISION_UNUSED = ("post_layernorm.",)
_M = TypeVar("_M", bound=nn.Module)  # LLaVA reads hidden states, never the pooled output


def canonical_name(disk_name: str) -> str:
    """A tensor's name as transformers 5 writes it, whichever writer's name it has."""
    name = disk_name
    for old, new in _RENAMES:
        if name.startswith(old):
            name = new + name.removeprefix(old)
    return name


def config_of(directory: Path) -> LlavaConfig:
    try:
        return read_llava_config(directory)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def load_llava_vision(
    directory: Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> VisionTower:
    """The vision tower and projector (eval, no grad) from a LLaVA checkpoint directory, built
    from their tensors alone. CheckpointError for missing, unexpected or misshapen ones, by name."""
    directory = Path(directory)
    config = config_of(directory)
    with torch.device("meta"):
        model = VisionTower(config, dtype=dtype)
    # The whole checkpoint is checked from its headers first: a bad one reads no weights.
    check_state(directory, _vision_state(directory, config, dtype, meta=True), model.state_dict())
    state = _vision_state(directory, config, dtype, meta=False)
    return _assign(model, state, device)


def load_llava_language(
    directory: Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> LlamaForCausalLM:
    """The language model (eval, no grad) from a LLaVA checkpoint directory, ready for
    ``forward(..., image_rows, image_embeds)``. CheckpointError as load_llava_vision."""
    directory = Path(directory)
    config = config_of(directory).text
    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype=dtype)
    check_state(directory, _language_state(directory, config, dtype, meta=True), model.state_dict())
    state = _language_state(directory, config, dtype, meta=False)
    llama = _assign(model, state, device)
    llama.reset_rope_cache(device)
    return llama


def _assign(model: _M, state: dict[str, Tensor], device: torch.device | str) -> _M:
    model.load_state_dict({n: t.to(device) for n, t in state.items()}, strict=True, assign=True)
    model.eval()
    model.requires_grad_(False)
    return model


def _tensors(directory: Path, dtype: torch.dtype, meta: bool, prefixes: tuple[str, ...]) -> dict[str, Tensor]:
    """The checkpoint's tensors whose canonical name starts with one of ``prefixes``, by it.

    read_checkpoint has no name filter: every tensor is read (in ``dtype``) and the others are
    dropped here, so each of the two loaders reads the whole checkpoint once."""
    out: dict[str, Tensor] = {}
    for disk_name, tensor in read_checkpoint(directory, dtype, meta=meta).items():
        name = canonical_name(disk_name)
        if name.startswith(prefixes):
            if name in out:
                raise CheckpointError(f"{directory}: tensor {name!r} is stored twice (under two names)")
            out[name] = tensor
    return out


def _vision_state(
    directory: Path, config: LlavaConfig, dtype: torch.dtype, *, meta: bool
) -> dict[str, Tensor]:
    """The tower's and projector's tensors under our names, q/k/v fused (meta tensors when ``meta``)."""
    used = config.num_vision_layers_used
    state: dict[str, Tensor] = {}
    for name, tensor in _tensors(directory, dtype, meta, (VISION_PREFIX, PROJECTOR_PREFIX)).items():
        if name.startswith(PROJECTOR_PREFIX):
            state["projector." + name.removeprefix(PROJECTOR_PREFIX)] = tensor
            continue
        rest = name.removeprefix(VISION_PREFIX)
        if (match := _ENCODER_LAYER.fullmatch(rest)) is not None:
            if int(match[1]) >= used:
                continue  # past the selected hidden state: never run
            rest = f"layers.{match[1]}.{match[2]}"
        elif rest.startswith(_VISION_UNUSED):
            continue
        state[rest] = tensor
    size = config.vision.hidden_size
    for i in range(used):
        attn = f"layers.{i}.self_attn."
        for kind, shape in (("weight", (size, size)), ("bias", (size,))):
            parts = [_take(directory, state, f"{attn}{p}_proj.{kind}", shape, VISION_PREFIX) for p in "qkv"]
            state[f"{attn}qkv_proj.{kind}"] = torch.cat(parts)
    return state


def _language_state(
    directory: Path, config: LlamaConfig, dtype: torch.dtype, *, meta: bool
) -> dict[str, Tensor]:
    """The decoder's tensors under our names: q/k/v and gate/up fused, q/k rows interleaved."""
    state: dict[str, Tensor] = {}
    for name, tensor in _tensors(directory, dtype, meta, (TEXT_PREFIX, LM_HEAD)).items():
        if name == LM_HEAD:
            # Tied: the head is the embedding and a stored copy is ignored (as our other loaders
            # do; transformers 5 would instead keep a stored head that differs, untied).
            if not config.tie_word_embeddings:
                state[name] = tensor
        elif not name.endswith("rotary_emb.inv_freq"):  # a buffer some old writers saved
            state[name.removeprefix(TEXT_PREFIX)] = tensor
    hidden, inter = config.hidden_size, config.intermediate_size
    for i in range(config.num_hidden_layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."

        def take(name: str, rows: int) -> Tensor:
            return _take(directory, state, name, (rows, hidden), TEXT_PREFIX)

        q = rotate_half_to_interleaved(
            take(f"{attn}q_proj.weight", config.q_size), config.num_attention_heads
        )
        k = rotate_half_to_interleaved(
            take(f"{attn}k_proj.weight", config.kv_size), config.num_key_value_heads
        )
        v = take(f"{attn}v_proj.weight", config.kv_size)
        state[f"{attn}qkv_proj.weight"] = torch.cat([q, k, v])
        gate, up = take(f"{mlp}gate_proj.weight", inter), take(f"{mlp}up_proj.weight", inter)
        state[f"{mlp}gate_up_proj.weight"] = torch.cat([gate, up])
    return state


def rotate_half_to_interleaved(weight: Tensor, num_heads: int) -> Tensor:
    """Q or K rows [num_heads * head_dim, in] from HF's layout (rotary pairs (j, j + head_dim/2)) to
    ggml's (pairs (2j, 2j + 1)): llama.cpp convert_hf_to_gguf's permute."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    out = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:]).swapaxes(1, 2)
    return out.reshape(weight.shape)


def interleaved_to_rotate_half(weight: Tensor, num_heads: int) -> Tensor:
    """The inverse of rotate_half_to_interleaved (for writing our weights under HF's layout)."""
    head_dim = weight.shape[0] // num_heads
    out = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2)
    return out.reshape(weight.shape)


def _take(
    directory: Path, state: dict[str, Tensor], name: str, shape: tuple[int, ...], prefix: str
) -> Tensor:
    """Pop one part of a fused projection, checked: fusing misshapen parts would fail unnamed."""
    tensor = state.pop(name, None)
    if tensor is None:
        raise CheckpointError(f"{directory}: tensor {prefix + name!r} is missing")
    if tuple(tensor.shape) != shape:
        raise CheckpointError(
            f"{directory}: {prefix + name}: shape {list(tensor.shape)}, config says {list(shape)}"
        )
    return tensor
