"""LlamaConfig: the shape and constants of a llama-family model, read from GGUF metadata."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from libs.kvstore.kv_spec import KVSpec
from libs.modelfiles import require_positive


@dataclasses.dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        require_positive(
            self,
            (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "max_position_embeddings",
            ),
        )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"LlamaConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"LlamaConfig.head_dim must be even for rotary, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def kv_spec(self) -> KVSpec:
        return KVSpec.mha(self.num_hidden_layers, self.num_key_value_heads, self.head_dim)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LlamaConfig:
        return cls(
            **{field.name: data[field.name] for field in dataclasses.fields(cls) if field.name in data}
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], *, tie_word_embeddings: bool) -> LlamaConfig:
        """Build from GGUF key/value metadata (plain Python values, llama.cpp's key names).

        tie_word_embeddings is not metadata: it is True when the file has no `output.weight`.
        The vocabulary size comes from `<arch>.vocab_size` or, failing that, the token list length
        (pass `tokenizer.ggml.tokens` or its length under that key).
        """
        arch = metadata.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"unsupported GGUF architecture {arch!r}: only 'llama' is supported")
        scaling = metadata.get("llama.rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise ValueError(f"unsupported GGUF rope scaling {scaling!r} (llama.rope.scaling.type)")

        def need(key: str) -> Any:
            if key not in metadata:
                raise ValueError(f"GGUF metadata lacks required key {key!r}")
            return metadata[key]

        hidden = int(need("llama.embedding_length"))
        heads = int(need("llama.attention.head_count"))
        tokens = metadata.get("tokenizer.ggml.tokens")
        vocab = metadata.get("llama.vocab_size", tokens if isinstance(tokens, int) else len(tokens or ()))
        head_dim = metadata.get("llama.attention.key_length", metadata.get("llama.rope.dimension_count"))
        bos, eos = metadata.get("tokenizer.ggml.bos_token_id"), metadata.get("tokenizer.ggml.eos_token_id")
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(need("llama.feed_forward_length")),
            num_hidden_layers=int(need("llama.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(metadata.get("llama.attention.head_count_kv", heads)),
            head_dim=int(head_dim) if head_dim is not None else hidden // heads,
            rope_theta=_float32(metadata.get("llama.rope.freq_base", 10000.0)),
            rms_norm_eps=_float32(need("llama.attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(need("llama.context_length")),
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_id=int(eos) if eos is not None else None,
        )


def _float32(value: Any) -> float:
    """A GGUF float32 as the shortest decimal that rounds to it (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))
