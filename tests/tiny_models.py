"""Tiny random-weight model shapes shared by the unit tests (no model file needed)."""

from __future__ import annotations

from libs.modelfiles.llama_config import LlamaConfig

# GQA (4 query heads over 2 KV heads), tied head, small enough that a forward takes milliseconds.
TINY_LLAMA = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
