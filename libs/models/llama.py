"""Llama-family decoder in plain torch over a flat varlen token layout.

RMSNorm, interleaved RoPE, grouped-query attention, SwiGLU MLP, optionally tied LM head.

Tokens of every sequence in a step are concatenated into one [num_tokens] batch, as in vLLM; which
token belongs to which sequence, and what it may attend to, is the AttentionFn's business. Q and K
weights are expected in GGUF/ggml order, so rotary rotates interleaved pairs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from libs.kernels.linear import Linear
from libs.kernels.rotary import apply_rotary_qk, prepare_rotation, rope_cos_sin_cache
from libs.modelfiles.llama_config import LlamaConfig
from libs.models.attention import AttentionFn
from libs.models.layers import CausalLMBase, GatedMLP, RMSNorm


class LlamaAttention(nn.Module):
    def __init__(
        self, config: LlamaConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        # One fused projection; rows are [q | k | v]. Typed nn.Module: quantize_model swaps in packed layers.
        self.qkv_proj: nn.Module = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=False, dtype=dtype, device=device
        )
        self.o_proj: nn.Module = Linear(
            self.q_size, config.hidden_size, bias=False, dtype=dtype, device=device
        )

    def forward(
        self,
        positions: Tensor,
        hidden: Tensor,
        cos_sin_cache: Tensor,
        rotation: Tensor | None,
        attention: AttentionFn,
    ) -> Tensor:
        """rotation: the step's rotary rotation from prepare_rotation (None: built here if needed)."""
        num_tokens = hidden.shape[0]
        qkv: Tensor = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary_qk(q, k, positions, cos_sin_cache, rotation)
        out = attention(self.layer_idx, q, k, v)  # [num_tokens, num_heads, head_dim]
        result: Tensor = self.o_proj(out.reshape(num_tokens, self.q_size))
        return result


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: LlamaConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(config, layer_idx, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype, device)

    def forward(
        self,
        positions: Tensor,
        hidden: Tensor,
        residual: Tensor | None,
        cos_sin_cache: Tensor,
        rotation: Tensor | None,
        attention: AttentionFn,
    ) -> tuple[Tensor, Tensor]:
        """One pre-norm block. The residual stream is carried separately so each norm fuses the add.

        hidden: [num_tokens, hidden_size] in the model dtype is the previous block's output, not yet
        added; residual: [num_tokens, hidden_size] in fp32 (None before the first block). Returns
        (this block's output, residual stream before adding it). rotation: the step's rotary
        rotation from prepare_rotation, shared by every layer. The residual stays fp32 even in
        a bf16 model: SmolLM2's outlier channels reach ~25k, where bf16 rounds to multiples of 128
        and greedy decoding visibly drifts.
        """
        if residual is None:
            residual = hidden.float()
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, cos_sin_cache, rotation, attention)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        hidden = self.mlp(hidden)
        return hidden, residual


class LlamaForCausalLM(CausalLMBase):
    """The model: embeddings, decoder layers, final norm and LM head (tied to the embeddings if asked).

    Built with random weights from a LlamaConfig (tests), or on the meta device and then filled by a
    loader via `load_state_dict(..., assign=True)` followed by `reset_rope_cache`.
    """

    def __init__(
        self,
        config: LlamaConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        dev = torch.device(device) if device is not None else None
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=dev)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, dtype, dev) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, dev)
        # None while tied to the embeddings; quantize_model may install a quantized copy here.
        self.lm_head: nn.Module | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=dev)
        # Derived from the config, so not part of the state dict. Kept in fp32: rotary runs in fp32.
        self.cos_sin_cache: Tensor
        self.register_buffer("cos_sin_cache", self._build_rope_cache(dev), persistent=False)

    def _build_rope_cache(self, device: torch.device | None) -> Tensor:
        cfg = self.config
        cache = rope_cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, torch.float32)
        return cache.to(device) if device is not None else cache

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attention: AttentionFn,
        image_rows: Tensor | None = None,
        image_embeds: Tensor | None = None,
    ) -> Tensor:
        """input_ids, positions: [num_tokens] int64 -> final-normed hidden [num_tokens, hidden_size].

        image_rows: [M] int64 indices into the flat batch whose token embeddings are replaced by
        image_embeds [M, hidden_size] (cast to the model dtype): a vision-language model's image
        placeholder tokens, overwritten as transformers' masked_scatter does. Both or neither.
        """
        hidden: Tensor = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        if (image_rows is None) != (image_embeds is None):
            raise ValueError("image_rows and image_embeds go together")
        if image_rows is not None and image_embeds is not None:
            # Fresh from the embedding lookup, so overwriting in place touches no weights.
            hidden.index_copy_(0, image_rows, image_embeds.to(hidden.dtype))
        residual: Tensor | None = None
        # Rotary's per-position rotation depends on positions only: built once for all layers.
        rotation = prepare_rotation(positions, self.cos_sin_cache, hidden.dtype)
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, self.cos_sin_cache, rotation, attention)
        assert residual is not None  # LlamaConfig guarantees at least one layer
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden
