"""Random-weight llama models of published layer shapes, for benchmarks whose result depends on a
model's shape rather than on what it says: e.g. how much of a prefill is attention (SmolLM2-135M on
a CPU: most of it; a 70B model: about a tenth).

A spec is ``smollm2`` (the embedded model itself) or ``<shape>[:<layers>]`` with a shape from SHAPES,
e.g. ``llama-3-70b:1`` for one decoder layer of Llama-3-70B's shape. Per-layer costs do not depend
on the number of layers, so a cut model keeps a full one's ratios at a fraction of the time.

As a GGUF (for the stack), a random model carries the embedded model's tokenizer and chat template,
and is written once per spec into ``<cache dir>/bench-models``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from libs.modelfiles.llama_config import LlamaConfig
from libs.modelfiles.registry import resolve_model_path
from libs.models.gguf_writer import write_llama_gguf
from libs.models.llama import LlamaForCausalLM

EMBEDDED = "smollm2"
INIT_STD = 0.02  # activations stay O(1) through a few layers in bf16
# (hidden, MLP, attention heads, KV heads, layers); head_dim = hidden / heads = 64 or 128
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "smollm2": (576, 1536, 9, 3, 30),
    "llama-3-8b": (4096, 14336, 32, 8, 32),
    "llama-3-70b": (8192, 28672, 64, 8, 80),
}


def model_config(spec: str, vocab_size: int = 49152) -> LlamaConfig:
    """The LlamaConfig of ``<shape>[:<layers>]`` (the embedded tokenizer's vocabulary by default)."""
    name, _, layers = spec.partition(":")
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    hidden, intermediate, heads, kv_heads, num_layers = SHAPES[name]
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=int(layers) if layers else num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )


def random_model(config: LlamaConfig, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    """The model built on ``device`` with N(0, INIT_STD) projections and unit norms (seeded)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, dtype=dtype, device=device).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, INIT_STD)
    return model


def gguf_path(spec: str, cache_dir: str | Path) -> Path:
    """The GGUF for ``spec``: the embedded model's file, or a random one written on first use."""
    if spec == EMBEDDED:
        return resolve_model_path(EMBEDDED)
    config = model_config(spec)
    name = f"{spec.partition(':')[0]}-{config.num_hidden_layers}-layer-random"
    path = Path(cache_dir) / "bench-models" / f"{name}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_random_gguf(tmp, config)
        tmp.rename(path)
    return path


def write_random_gguf(path: Path, config: LlamaConfig) -> None:
    """``config``'s weights drawn at random (f16), with the embedded model's tokenizer."""

    def tokenizer(writer: gguf.GGUFWriter) -> None:
        for field in gguf.GGUFReader(resolve_model_path(EMBEDDED)).fields.values():
            if field.name.startswith("tokenizer."):
                sub_type = field.types[1] if len(field.types) > 1 else None
                writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)

    rng = np.random.default_rng(0)

    def weights() -> Iterator[tuple[str, np.ndarray]]:
        for name, shape in _tensor_shapes(config).items():
            if name.endswith("norm.weight"):
                yield name, np.ones(shape, dtype=np.float16)
            else:
                yield name, (rng.standard_normal(shape, dtype=np.float32) * INIT_STD).astype(np.float16)

    write_llama_gguf(path, config, weights(), add_metadata=tokenizer)


def _tensor_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """llama.cpp's tensor names -> (out, in) shapes (tied head: no ``output.weight``)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (config.vocab_size, hidden),
        "output_norm.weight": (hidden,),
    }
    for i in range(config.num_hidden_layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (config.q_size, hidden),
            f"blk.{i}.attn_k.weight": (config.kv_size, hidden),
            f"blk.{i}.attn_v.weight": (config.kv_size, hidden),
            f"blk.{i}.attn_output.weight": (hidden, config.q_size),
            f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.ffn_gate.weight": (inter, hidden),
            f"blk.{i}.ffn_up.weight": (inter, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, inter),
        }
    return shapes
