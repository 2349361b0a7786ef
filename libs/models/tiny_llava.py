"""Tiny random LLaVA checkpoints (CLIP tower, projector, llama decoder), for tests and benches.

A 3-layer CLIP ViT (hidden 32, 4 heads, quick_gelu) over 32x32 images in 8x8 patches, features
from layer -2 without CLS (16 per image), a gelu projector, and a 2-layer llama (hidden 64, GQA
4/2 heads, untied head) over SmolLM2's vocabulary plus one added special token ``<image>``.
Weights are drawn with std 0.08 (norms around 1) under transformers' names, without
transformers, so transformers' LlavaForConditionalGeneration is an independent reader of it.
tokenizer.json and tokenizer_config.json are SmolLM2's (from the embedded GGUF, ChatML template).

    python -m libs.models.tiny_llava DIR [--seed N]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken

from libs.modelfiles.llava_config import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    PIL_BICUBIC,
    LlavaConfig,
    read_llava_config,
)
from libs.modelfiles.registry import resolve_model_path
from libs.models.llava_loader import LM_HEAD, PROJECTOR_PREFIX, TEXT_PREFIX, VISION_PREFIX
from libs.recipe.tokenizer import Tokenizer

INIT_STD = 0.08
IMAGE_TOKEN = "<image>"


def tiny_config_json(
    vocab_size: int, image_token_id: int, image_size: int = 32, patch_size: int = 8
) -> dict[str, Any]:
    """An HF config.json that transformers' LlavaForConditionalGeneration and our loader both read."""
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": image_token_id,
        "image_seq_length": (image_size // patch_size) ** 2,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "tie_word_embeddings": False,
        "dtype": "float32",
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "image_size": image_size,
            "patch_size": patch_size,
            "num_channels": 3,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
        },
        "text_config": {
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 2048,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    }


def tiny_preprocessor_json(image_size: int = 32) -> dict[str, Any]:
    """preprocessor_config.json: CLIPImageProcessor resizing and cropping to the tower's size."""
    return {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "size": {"shortest_edge": image_size},
        "crop_size": {"height": image_size, "width": image_size},
        "do_resize": True,
        "do_center_crop": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(OPENAI_CLIP_MEAN),
        "image_std": list(OPENAI_CLIP_STD),
        "resample": PIL_BICUBIC,
        "do_convert_rgb": True,
    }


def hf_tensor_shapes(config: LlavaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor transformers' LlavaForConditionalGeneration saves for ``config``, by name
    (the whole tower, post_layernorm and the layers past the selected one included)."""
    vision, text = config.vision, config.text
    v, inter = vision.hidden_size, vision.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.class_embedding": (v,),
        "embeddings.patch_embedding.weight": (v, vision.num_channels, vision.patch_size, vision.patch_size),
        "embeddings.position_embedding.weight": (vision.num_patches + 1, v),
    }
    for norm in ("pre_layrnorm", "post_layernorm"):
        shapes |= {f"{norm}.weight": (v,), f"{norm}.bias": (v,)}
    for i in range(vision.num_hidden_layers):
        layer = f"encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes |= {f"{layer}self_attn.{proj}.weight": (v, v), f"{layer}self_attn.{proj}.bias": (v,)}
        for norm in ("layer_norm1", "layer_norm2"):
            shapes |= {f"{layer}{norm}.weight": (v,), f"{layer}{norm}.bias": (v,)}
        shapes |= {f"{layer}mlp.fc1.weight": (inter, v), f"{layer}mlp.fc1.bias": (inter,)}
        shapes |= {f"{layer}mlp.fc2.weight": (v, inter), f"{layer}mlp.fc2.bias": (v,)}
    out = {VISION_PREFIX + name: shape for name, shape in shapes.items()}
    h = text.hidden_size
    projector: dict[str, tuple[int, ...]] = {"linear_1.weight": (h, v), "linear_2.weight": (h, h)}
    if config.projector_bias:
        projector |= {"linear_1.bias": (h,), "linear_2.bias": (h,)}
    out |= {PROJECTOR_PREFIX + name: shape for name, shape in projector.items()}
    return out | {TEXT_PREFIX + name: shape for name, shape in _llama_shapes(config).items()}


def _llama_shapes(config: LlavaConfig) -> dict[str, tuple[int, ...]]:
    text = config.text
    h, inter = text.hidden_size, text.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (text.vocab_size, h), "norm.weight": (h,)}
    for i in range(text.num_hidden_layers):
        layer = f"layers.{i}."
        shapes |= {
            f"{layer}input_layernorm.weight": (h,),
            f"{layer}post_attention_layernorm.weight": (h,),
            f"{layer}self_attn.q_proj.weight": (text.q_size, h),
            f"{layer}self_attn.k_proj.weight": (text.kv_size, h),
            f"{layer}self_attn.v_proj.weight": (text.kv_size, h),
            f"{layer}self_attn.o_proj.weight": (h, text.q_size),
            f"{layer}mlp.gate_proj.weight": (inter, h),
            f"{layer}mlp.up_proj.weight": (inter, h),
            f"{layer}mlp.down_proj.weight": (h, inter),
        }
    return shapes


def random_tensors(config: LlavaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 weights drawn N(0, INIT_STD^2) under HF names; norm weights 1 + that noise."""
    generator = torch.Generator().manual_seed(seed)
    shapes = hf_tensor_shapes(config)
    if not config.text.tie_word_embeddings:
        shapes[LM_HEAD] = (config.text.vocab_size, config.text.hidden_size)
    out: dict[str, torch.Tensor] = {}
    for name, shape in sorted(shapes.items()):
        noise = torch.randn(shape, generator=generator) * INIT_STD
        is_norm_weight = name.endswith(".weight") and ("norm" in name or "layrnorm" in name)
        out[name] = 1 + noise if is_norm_weight else noise
    return out


def write_tokenizer(directory: Path) -> tuple[int, int]:
    """SmolLM2's tokenizer plus the special token ``<image>``; returns (vocab size, its id)."""
    tokenizer = Tokenizer.from_gguf(resolve_model_path("smollm2"), None)
    backend = tokenizer._backend  # a tokenizers.Tokenizer, built fresh by from_gguf: ours to extend
    backend.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    image_token_id = backend.token_to_id(IMAGE_TOKEN)
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    if image_token_id != vocab_size - 1:
        raise RuntimeError(f"{IMAGE_TOKEN!r} got id {image_token_id}, not a new last one")
    backend.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "add_bos_token": tokenizer.add_bos,
        "chat_template": tokenizer.chat_template,
        "model_max_length": 2048,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return vocab_size, image_token_id


def write_tiny_llava(
    directory: Path,
    seed: int = 0,
    image_size: int = 32,
    patch_size: int = 8,
    shape: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    """Write a tiny random LLaVA checkpoint (config, weights, tokenizer, preprocessor) to ``directory``.
    ``shape``: fields of ``vision_config`` / ``text_config`` to set instead (a bench's larger tower)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size, image_token_id = write_tokenizer(directory)
    config_json = tiny_config_json(vocab_size, image_token_id, image_size, patch_size)
    for section, fields in (shape or {}).items():
        config_json[section].update(fields)
    (directory / "config.json").write_text(json.dumps(config_json, indent=2))
    (directory / "preprocessor_config.json").write_text(
        json.dumps(tiny_preprocessor_json(image_size), indent=2)
    )
    save_file(random_tensors(read_llava_config(directory), seed), str(directory / "model.safetensors"))
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_llava(args.directory, seed=args.seed))


if __name__ == "__main__":
    main()
