"""Write a llama-family GGUF of a given LlamaConfig: the inverse of ``read_gguf_config`` and the
loader, for model files that tests and benchmarks build from random or known weights."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import gguf
import numpy as np

from libs.modelfiles.llama_config import LlamaConfig


def write_llama_gguf(
    path: Path,
    config: LlamaConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    *,
    arch: str = "llama",
    add_metadata: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """``tensors`` under llama.cpp's names (``blk.{i}.attn_q.weight``, ...), shaped (out, in) as
    torch keeps them, in their own numpy dtype; ``add_metadata`` adds keys beyond the shape (token
    ids, a tokenizer). ``arch`` names the keys' prefix (another than llama: the loader refuses it)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if add_metadata is not None:
        add_metadata(writer)
    for name, array in tensors:
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
