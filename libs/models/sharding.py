"""How each model family's weights split over tensor-parallel ranks (``shard_model``), and the
collectives installed after (``parallelize``): a loaded model becomes this rank's shard in place.

Llama: attention by KV-head group (rank r holds KV heads [a, b) and the query heads that read
them; SmolLM2's 3 KV heads over 2 ranks are 2 and 1, with 6 and 3 query heads), the fused qkv
and gate/up projections column-parallel, o and down row-parallel, the MLP by intermediate channel.

DeepSeek-V3 (MLA): attention by query head. The latent projection (kv_a) and its norm are
replicated, and every rank caches the whole latent: every head reads all of it, so splitting it
would need every rank to hold every head's query (DeepSeek's own serving avoids the copies with
data-parallel attention instead). kv_b (per head) and o are split by head. MoE layers split either
every expert by intermediate channel (tensor parallel), or whole experts over ranks
(``expert_parallel``): every rank routes every token (the router is replicated and its input is
the same everywhere), runs the pairs that chose its own experts, and the all-reduce that ends the
block combines them; there the shared expert is replicated and added by rank 0 alone (tensor
parallel, it is split like a dense MLP).

Both: the embedding and the LM head split the vocabulary. The norms and the rotary table are
replicated. ``model.config`` stays the whole model's; the attention modules' head counts become
the rank's. Order: ``shard_model``, then any weight quantization (it sees plain ``Linear`` shards),
then ``parallelize``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from libs.kernels.linear import Linear
from libs.kernels.moe import routed_experts
from libs.kvstore.kv_spec import MHA, KVSpec
from libs.modelfiles.deepseek_config import DeepseekV3Config
from libs.modelfiles.llama_config import LlamaConfig
from libs.models.deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3DecoderLayer,
    DeepseekV3ForCausalLM,
    DeepseekV3MoE,
    RoutedExperts,
)
from libs.models.layers import GatedMLP
from libs.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from libs.models.parallel import (
    RowParallel,
    TiedHead,
    TPGroup,
    VocabParallelEmbedding,
    VocabParallelHead,
    scaled,
    split_evenly,
)

Model = LlamaForCausalLM | DeepseekV3ForCausalLM


@dataclass(frozen=True, slots=True)
class RankLayout:
    """How a model's KV and experts lie over ``tp_size`` ranks: the KV heads each rank holds
    (MLA: every rank holds the one latent entry) and whether experts are split whole."""

    tp_size: int
    kv_heads: tuple[range, ...]
    expert_parallel: bool

    @classmethod
    def of(cls, config: LlamaConfig | DeepseekV3Config, tp_size: int, expert_parallel: bool) -> RankLayout:
        spec = config.kv_spec()
        if tp_size > 1:
            heads = config.num_attention_heads if spec.kind != MHA else spec.num_kv_heads
            if tp_size > heads:
                what = "KV heads" if spec.kind == MHA else "attention heads"
                raise ValueError(f"tensor_parallel_size {tp_size}: the model has {heads} {what}")
        if expert_parallel and not getattr(config, "n_routed_experts", 0):
            raise ValueError("expert_parallel: the model has no routed experts")
        if spec.kind == MHA:
            kv_heads = tuple(split_evenly(spec.num_kv_heads, tp_size))
        else:
            kv_heads = (range(1),) * tp_size
        return cls(tp_size, kv_heads, expert_parallel)

    def describe(self) -> str:
        """What the KV fingerprint folds in: '' for one rank (today's fingerprints unchanged)."""
        if self.tp_size == 1:
            return ""
        heads = ",".join(f"{r.start}-{r.stop}" for r in self.kv_heads)
        return f"tp{self.tp_size}:kv{heads}" + (":ep" if self.expert_parallel else "")

    def num_heads(self, config: LlamaConfig | DeepseekV3Config, rank: int) -> int:
        """The query heads rank ``rank`` computes."""
        if isinstance(config, LlamaConfig):
            return len(self.kv_heads[rank]) * (config.num_attention_heads // config.num_key_value_heads)
        return len(split_evenly(config.num_attention_heads, self.tp_size)[rank])

    def kv_spec(self, full: KVSpec, rank: int) -> KVSpec:
        """The KV one rank holds: its heads (MHA) or the whole latent entry (MLA)."""
        if full.kind != MHA:
            return full
        return KVSpec.mha(full.num_layers, len(self.kv_heads[rank]), full.head_dim)


@dataclass(frozen=True, slots=True)
class Shard:
    """Which part of a model this process keeps: its rank in ``tp``, experts split whole or not."""

    tp: TPGroup
    expert_parallel: bool = False

    def layout(self, config: LlamaConfig | DeepseekV3Config) -> RankLayout:
        return RankLayout.of(config, self.tp.size, self.expert_parallel)


def _rows(layer: nn.Module, *parts: range) -> Linear:
    """A Linear holding rows ``parts`` (concatenated) of ``layer``'s weight: column parallel."""
    weight = layer.weight
    assert isinstance(weight, Tensor)
    rows = torch.cat([weight[r.start : r.stop] for r in parts])
    return _linear_of(rows)


def _columns(layer: nn.Module, part: range) -> Linear:
    """A Linear holding input columns ``part`` of ``layer``'s weight: row parallel."""
    weight = layer.weight
    assert isinstance(weight, Tensor)
    return _linear_of(weight[:, part.start : part.stop])


def _linear_of(weight: Tensor) -> Linear:
    out = Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype, device=weight.device)
    out.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
    return out


def _shard_mlp(mlp: nn.Module, tp: TPGroup) -> None:
    assert isinstance(mlp, GatedMLP)
    down = mlp.down_proj.weight
    assert isinstance(down, Tensor)
    inner = down.shape[1]
    part = split_evenly(inner, tp.size)[tp.rank]
    mlp.gate_up_proj = _rows(mlp.gate_up_proj, part, scaled(part, 1, inner))
    mlp.down_proj = _columns(mlp.down_proj, part)


def _shard_llama_attention(attn: nn.Module, config: LlamaConfig, layout: RankLayout, rank: int) -> None:
    assert isinstance(attn, LlamaAttention)
    kv = layout.kv_heads[rank]
    per_kv, head_dim = config.num_attention_heads // config.num_key_value_heads, config.head_dim
    q_rows = scaled(kv, per_kv * head_dim)
    attn.qkv_proj = _rows(
        attn.qkv_proj,
        q_rows,
        scaled(kv, head_dim, config.q_size),
        scaled(kv, head_dim, config.q_size + config.kv_size),
    )
    attn.o_proj = _columns(attn.o_proj, q_rows)
    attn.num_heads, attn.num_kv_heads = len(kv) * per_kv, len(kv)
    attn.q_size, attn.kv_size = len(q_rows), len(kv) * head_dim


def _shard_mla_attention(attn: nn.Module, config: DeepseekV3Config, tp: TPGroup) -> None:
    assert isinstance(attn, DeepseekV3Attention)
    heads = split_evenly(config.num_attention_heads, tp.size)[tp.rank]
    q_rows = scaled(heads, config.qk_head_dim)
    if attn.q_proj is not None:
        attn.q_proj = _rows(attn.q_proj, q_rows)
    else:
        attn.q_b_proj = _rows(attn.q_b_proj, q_rows)
    attn.kv_b_proj = _rows(attn.kv_b_proj, scaled(heads, attn.nope_dim + attn.v_dim))
    attn.o_proj = _columns(attn.o_proj, scaled(heads, attn.v_dim))
    attn.num_heads = len(heads)


class LocalExperts(nn.Module):
    """An expert-parallel rank's routed experts, ids [first, first + n): the (token, expert)
    pairs that chose another rank's expert are skipped here and added there."""

    def __init__(self, experts: RoutedExperts, part: range) -> None:
        super().__init__()
        self.first = part.start
        self.gate_up_proj = nn.Parameter(
            experts.gate_up_proj[part.start : part.stop].clone(), requires_grad=False
        )
        self.down_proj = nn.Parameter(experts.down_proj[part.start : part.stop].clone(), requires_grad=False)

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        return routed_experts(x, weights, ids, self.gate_up_proj, self.down_proj, first_expert=self.first)


def _shard_moe(moe: DeepseekV3MoE, config: DeepseekV3Config, tp: TPGroup, expert_parallel: bool) -> None:
    experts = moe.experts
    assert isinstance(experts, RoutedExperts)
    if expert_parallel:
        moe.experts = LocalExperts(experts, split_evenly(config.n_routed_experts, tp.size)[tp.rank])
        if tp.rank != 0:
            moe.shared_experts = None  # replicated: rank 0's copy is added once, before the all-reduce
        return
    inner = config.moe_intermediate_size
    part = split_evenly(inner, tp.size)[tp.rank]
    gate_up = experts.gate_up_proj
    experts.gate_up_proj = nn.Parameter(
        torch.cat(
            [gate_up[:, part.start : part.stop], gate_up[:, inner + part.start : inner + part.stop]], 1
        ),
        requires_grad=False,
    )
    experts.down_proj = nn.Parameter(
        experts.down_proj[:, :, part.start : part.stop].clone(), requires_grad=False
    )
    if moe.shared_experts is not None:
        _shard_mlp(moe.shared_experts, tp)


def _shard_vocab(model: Model, tp: TPGroup) -> None:
    part = split_evenly(model.config.vocab_size, tp.size)[tp.rank]
    table = model.embed_tokens.weight.detach()[part.start : part.stop].clone()
    model.embed_tokens = VocabParallelEmbedding(table, part.start, tp)
    if model.lm_head is not None:
        model.lm_head = _rows(model.lm_head, part)


def shard_model(model: Model, shard: Shard) -> None:
    """Keep this rank's part of every split weight, in place (ValueError: a split the model's
    shape does not allow, e.g. more ranks than KV heads)."""
    tp, layout = shard.tp, shard.layout(model.config)
    if isinstance(model, LlamaForCausalLM):
        for layer in model.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            _shard_llama_attention(layer.self_attn, model.config, layout, tp.rank)
            _shard_mlp(layer.mlp, tp)
    else:
        for layer in model.layers:
            assert isinstance(layer, DeepseekV3DecoderLayer)
            _shard_mla_attention(layer.self_attn, model.config, tp)
            if isinstance(layer.mlp, DeepseekV3MoE):
                _shard_moe(layer.mlp, model.config, tp, layout.expert_parallel)
            else:
                _shard_mlp(layer.mlp, tp)
    _shard_vocab(model, tp)


def parallelize(model: Model, tp: TPGroup) -> None:
    """Install the collectives on a sharded model: an all-reduce after each attention and each
    MLP / MoE, and the LM head's gather of the vocabulary (a tied head reads the table's shard)."""
    for layer in model.layers:
        assert isinstance(layer, LlamaDecoderLayer | DeepseekV3DecoderLayer)
        # The decoder layer calls these as it calls the unsharded parts (same arguments).
        layer.self_attn = RowParallel(layer.self_attn, tp)  # type: ignore[assignment]
        layer.mlp = RowParallel(layer.mlp, tp)
    head = model.lm_head if model.lm_head is not None else TiedHead(model.embed_tokens)
    widths = [len(r) for r in split_evenly(model.config.vocab_size, tp.size)]
    model.lm_head = VocabParallelHead(head, widths, tp)
