"""DeepSeek-V3-family decoder in plain torch over a flat varlen token layout.

MLA attention (low-rank q and kv with their norms, decoupled interleaved rope, YaRN), DeepSeekMoE
after `first_k_dense_replace` dense SwiGLU layers (sigmoid grouped top-k with a selection bias,
routed scaling, shared experts), and the MTP modules that draft the token after next.

As in llama.py, the tokens of every sequence in a step form one [num_tokens] batch and the
attention function owns the cache: here an MLAAttentionFn, which caches one latent entry per
token and layer. MTP module k runs as layer `num_hidden_layers + k`, with a cache of its own.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from libs.kernels.linear import Linear, linear
from libs.kernels.mla_attention import MLAWeights
from libs.kernels.moe import grouped_topk, routed_experts
from libs.kernels.rotary import apply_rotary_qk, prepare_rotation, rope_cos_sin_cache, yarn_cos_sin_cache
from libs.modelfiles.deepseek_config import DeepseekV3Config
from libs.models.attention import MLAAttentionFn
from libs.models.layers import CausalLMBase, GatedMLP, RMSNorm

# The q and kv latent norms use a fixed eps in DeepSeek's reference and in transformers.
_LATENT_NORM_EPS = 1e-6


def _linear(
    in_features: int, out_features: int, dtype: torch.dtype, device: torch.device | None
) -> nn.Linear:
    return Linear(in_features, out_features, bias=False, dtype=dtype, device=device)


class DeepseekV3Attention(nn.Module):
    def __init__(
        self, config: DeepseekV3Config, layer_idx: int, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.scale = config.softmax_scale
        q_out = self.num_heads * config.qk_head_dim
        self.q_proj: nn.Module | None = None
        if config.q_lora_rank is None:
            self.q_proj = _linear(config.hidden_size, q_out, dtype, device)
        else:
            self.q_a_proj: nn.Module = _linear(config.hidden_size, config.q_lora_rank, dtype, device)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, _LATENT_NORM_EPS, dtype, device)
            self.q_b_proj: nn.Module = _linear(config.q_lora_rank, q_out, dtype, device)
        self.kv_a_proj_with_mqa: nn.Module = _linear(
            config.hidden_size, self.kv_lora_rank + self.rope_dim, dtype, device
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS, dtype, device)
        # Stays a plain Linear: its weight is read per head (mla_weights), never quantized.
        self.kv_b_proj = _linear(
            self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), dtype, device
        )
        self.o_proj: nn.Module = _linear(self.num_heads * self.v_dim, config.hidden_size, dtype, device)

    def mla_weights(self) -> MLAWeights:
        """kv_b_proj's rows per head: [W_UK (nope_dim rows) ; W_UV (v_dim rows)], as views."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return MLAWeights(w[:, : self.nope_dim], w[:, self.nope_dim :], self.scale)

    def forward(
        self,
        positions: Tensor,
        hidden: Tensor,
        cos_sin_cache: Tensor,
        rotation: Tensor | None,
        attention: MLAAttentionFn,
    ) -> Tensor:
        num_tokens = hidden.shape[0]
        if self.q_proj is not None:
            q: Tensor = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = torch.split(q, [self.nope_dim, self.rope_dim], dim=-1)
        kv: Tensor = self.kv_a_proj_with_mqa(hidden)  # [num_tokens, kv_lora_rank + rope_dim]
        latent, k_pe = torch.split(kv, [self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        # The checkpoint keeps rope dims in interleaved pairs, as DeepSeek's reference rotates them.
        q_pe, k_pe = apply_rotary_qk(
            q_pe, k_pe.view(num_tokens, 1, self.rope_dim), positions, cos_sin_cache, rotation
        )
        out = attention(self.layer_idx, q_nope, q_pe, latent, k_pe[:, 0], self.mla_weights())
        result: Tensor = self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))
        return result


class TopkRouter(nn.Module):
    """The gate: fp32 logits and selection bias (kept fp32 in every model dtype, as transformers does)."""

    def __init__(self, config: DeepseekV3Config, device: torch.device | None) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size, device=device))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts, device=device))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x: [num_tokens, hidden] -> (weights [num_tokens, top_k] fp32, expert ids [num_tokens, top_k])."""
        cfg = self.config
        return grouped_topk(
            linear(x.float(), self.weight),
            self.e_score_correction_bias,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            top_k=cfg.num_experts_per_tok,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
        )


class RoutedExperts(nn.Module):
    def __init__(self, config: DeepseekV3Config, dtype: torch.dtype, device: torch.device | None) -> None:
        super().__init__()
        num, hidden, inner = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(num, 2 * inner, hidden, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.zeros(num, hidden, inner, dtype=dtype, device=device))

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        return routed_experts(x, weights, ids, self.gate_up_proj, self.down_proj)


class DeepseekV3MoE(nn.Module):
    def __init__(self, config: DeepseekV3Config, dtype: torch.dtype, device: torch.device | None) -> None:
        super().__init__()
        self.gate = TopkRouter(config, device)
        self.experts: nn.Module = RoutedExperts(config, dtype, device)  # (sharding may swap in LocalExperts)
        self.shared_experts: GatedMLP | None = None
        if config.n_shared_experts:
            shared = config.moe_intermediate_size * config.n_shared_experts
            self.shared_experts = GatedMLP(config.hidden_size, shared, dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = self.gate(x)
        out: Tensor = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: DeepseekV3Config,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device | None,
        *,
        moe: bool,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = DeepseekV3Attention(config, layer_idx, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp: nn.Module = (
            DeepseekV3MoE(config, dtype, device)
            if moe
            else GatedMLP(config.hidden_size, config.intermediate_size, dtype, device)
        )

    def forward(
        self,
        positions: Tensor,
        hidden: Tensor,
        residual: Tensor | None,
        cos_sin_cache: Tensor,
        rotation: Tensor | None,
        attention: MLAAttentionFn,
    ) -> tuple[Tensor, Tensor]:
        """One pre-norm block; the residual stream is carried apart, in fp32 (see llama.py)."""
        if residual is None:
            residual = hidden.float()
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, cos_sin_cache, rotation, attention)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        hidden = self.mlp(hidden)
        return hidden, residual


class DeepseekV3MTP(nn.Module):
    """One multi-token-prediction module: from the main model's final-normed hidden h_i and the
    next token t_{i+1}, the hidden that predicts t_{i+2}:
    h' = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]) (embedding first, as DeepSeek's weights
    expect), then one MoE decoder block, then its own norm. The embedding and the head are the
    main model's (V3 stores copies of the same tensors)."""

    def __init__(
        self, config: DeepseekV3Config, layer_idx: int, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        super().__init__()
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.eh_proj = _linear(2 * config.hidden_size, config.hidden_size, dtype, device)
        self.block = DeepseekV3DecoderLayer(config, layer_idx, dtype, device, moe=config.n_routed_experts > 0)
        self.shared_head_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(
        self,
        next_embeds: Tensor,
        hidden: Tensor,
        positions: Tensor,
        cos_sin_cache: Tensor,
        rotation: Tensor | None,
        attention: MLAAttentionFn,
    ) -> Tensor:
        """next_embeds, hidden: [num_tokens, hidden_size] -> normed hidden for the LM head."""
        fused = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        out, residual = self.block(positions, fused, None, cos_sin_cache, rotation, attention)
        normed, _ = self.shared_head_norm.add_and_norm(out, residual)
        return normed


class DeepseekV3ForCausalLM(CausalLMBase):
    """Embeddings, decoder layers, final norm, LM head, and the MTP modules (layers L, L+1, ..).

    Built with random weights from a config (tests), or on the meta device and then filled by a
    loader via `load_state_dict(..., assign=True)` followed by `reset_rope_cache`.
    """

    def __init__(
        self,
        config: DeepseekV3Config,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        dev = torch.device(device) if device is not None else None
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=dev)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, i, dtype, dev, moe=i >= config.first_k_dense_replace)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, dev)
        self.lm_head: nn.Module | None = None
        if not config.tie_word_embeddings:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, dtype, dev)
        self.mtp = nn.ModuleList(
            DeepseekV3MTP(config, config.num_hidden_layers + k, dtype, dev)
            for k in range(config.num_nextn_predict_layers)
        )
        self.cos_sin_cache: Tensor
        self.register_buffer("cos_sin_cache", self._build_rope_cache(dev), persistent=False)

    def _build_rope_cache(self, device: torch.device | None) -> Tensor:
        cfg, yarn = self.config, self.config.rope_scaling
        if yarn is None:
            cache = rope_cos_sin_cache(
                cfg.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta, torch.float32
            )
        else:
            cache = yarn_cos_sin_cache(
                cfg.qk_rope_head_dim,
                cfg.max_position_embeddings,
                cfg.rope_theta,
                yarn.factor,
                yarn.original_max_position_embeddings,
                yarn.beta_fast,
                yarn.beta_slow,
                yarn.attention_factor,
                torch.float32,
            )
        return cache.to(device) if device is not None else cache

    def forward(self, input_ids: Tensor, positions: Tensor, attention: MLAAttentionFn) -> Tensor:
        """input_ids, positions: [num_tokens] int64 -> final-normed hidden [num_tokens, hidden_size]."""
        hidden: Tensor = self.embed_tokens(input_ids)
        residual: Tensor | None = None
        rotation = prepare_rotation(positions, self.cos_sin_cache, hidden.dtype)
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, self.cos_sin_cache, rotation, attention)
        assert residual is not None  # the config guarantees at least one layer
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden

    def forward_mtp(
        self, k: int, next_ids: Tensor, hidden: Tensor, positions: Tensor, attention: MLAAttentionFn
    ) -> Tensor:
        """MTP module k: next_ids [num_tokens] (the token after each position), hidden the main
        model's final-normed hidden at those positions -> the hidden whose logits draft the token
        after next. positions are the main model's (module k's cache is layer L + k)."""
        rotation = prepare_rotation(positions, self.cos_sin_cache, hidden.dtype)
        module: DeepseekV3MTP = self.mtp[k]  # type: ignore[assignment]
        out: Tensor = module(
            self.embed_tokens(next_ids), hidden, positions, self.cos_sin_cache, rotation, attention
        )
        return out
