"""DeepseekV3Config: the shape and constants of a DeepSeek-V3-family model, read from HF config.json.

The family (V2-Lite, V3, R1, V3.1, V3.2 without its sparse indexer) shares one structure: MLA
attention over a low-rank latent, DeepSeekMoE after `first_k_dense_replace` dense layers, and
optional MTP modules stored after the last layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from libs.kvstore.kv_spec import KVSpec
from libs.modelfiles import require_positive


@dataclasses.dataclass(frozen=True, slots=True)
class YarnScaling:
    """YaRN rope scaling as DeepSeek configures it (`rope_scaling` / `rope_parameters`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @property
    def attention_factor(self) -> float:
        """The factor on cos/sin: mscale(mscale) / mscale(mscale_all_dim); 1.0 for V3."""
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class DeepseekV3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    moe_intermediate_size: int  # one routed expert; the shared expert is n_shared_experts times wider
    num_hidden_layers: int
    first_k_dense_replace: int
    num_attention_heads: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    q_lora_rank: int | None  # None: one plain q projection (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope_scaling: YarnScaling | None = None
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # MTP modules, stored as layers num_hidden_layers..
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        require_positive(
            self,
            (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "kv_lora_rank",
                "qk_rope_head_dim",
                "v_head_dim",
                "max_position_embeddings",
            ),
        )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepseekV3Config.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.num_moe_layers:
            self._check_routing()

    def _check_routing(self) -> None:
        experts, groups = self.n_routed_experts, self.n_group
        if groups < 1 or experts % groups or experts // groups < 2:
            # The group score is the sum of a group's top two experts.
            raise ValueError(f"n_routed_experts ({experts}) must split into n_group ({groups}) groups of >=2")
        if not 1 <= self.topk_group <= groups:
            raise ValueError(f"topk_group ({self.topk_group}) must be in 1..n_group ({groups})")
        if not 1 <= self.num_experts_per_tok <= self.topk_group * (experts // groups):
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..the experts of "
                f"topk_group groups ({self.topk_group * (experts // groups)})"
            )

    @property
    def num_moe_layers(self) -> int:
        return max(self.num_hidden_layers - self.first_k_dense_replace, 0)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(mscale_all_dim)^2 under YaRN (0.135234 for V3): the
        scale of the expanded form, and of the absorbed one too (the absorption keeps q.k)."""
        scale: float = self.qk_head_dim**-0.5
        if self.rope_scaling is not None and self.rope_scaling.mscale_all_dim:
            scale *= yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim) ** 2
        return scale

    def kv_spec(self) -> KVSpec:
        """One latent entry per token and main layer (the MTP modules' caches are the drafter's)."""
        return KVSpec.mla(self.num_hidden_layers, self.kv_lora_rank, self.qk_rope_head_dim)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_hf_config(cls, data: Mapping[str, Any]) -> DeepseekV3Config:
        """From a parsed HF config.json (DeepseekV3ForCausalLM / DeepseekV2ForCausalLM).

        Raises ValueError naming the field that is missing or unsupported.
        """

        def need(key: str) -> Any:
            if key not in data:
                raise ValueError(f"config.json lacks required field {key!r}")
            return data[key]

        rope = data.get("rope_scaling") or data.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("yarn", "default"):
            raise ValueError(f"config.json rope_scaling type {rope_type!r} is not supported (yarn or none)")
        scaling = None
        if rope_type == "yarn":
            scaling = YarnScaling(
                factor=float(rope["factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                beta_fast=float(rope.get("beta_fast") or 32),
                beta_slow=float(rope.get("beta_slow") or 1),
                mscale=float(rope.get("mscale") or 0),
                mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
            )
        routing = (data.get("scoring_func", "sigmoid"), data.get("topk_method", "noaux_tc"))
        if routing != ("sigmoid", "noaux_tc"):
            raise ValueError(f"config.json scoring_func/topk_method {routing}: only V3's sigmoid/noaux_tc")
        if data.get("attention_bias"):
            raise ValueError("config.json attention_bias=true is not supported")
        if data.get("rope_interleave", True) is not True:
            # DeepSeek's weights rotate interleaved pairs; a checkpoint asking otherwise is another model.
            raise ValueError("config.json rope_interleave=false is not supported (interleaved rope only)")
        if rope.get("attention_factor") is not None:
            raise ValueError(
                "config.json rope_scaling.attention_factor is not supported (derived from mscale)"
            )
        eos = data.get("eos_token_id")
        num_mtp = int(data.get("num_nextn_predict_layers", data.get("num_mtp_layers")) or 0)
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            first_k_dense_replace=int(data.get("first_k_dense_replace") or 0),
            num_attention_heads=int(need("num_attention_heads")),
            n_routed_experts=int(need("n_routed_experts")),
            n_shared_experts=int(data.get("n_shared_experts") or 0),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            n_group=int(data.get("n_group") or 1),
            topk_group=int(data.get("topk_group") or 1),
            routed_scaling_factor=float(data.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(data.get("norm_topk_prob", True)),
            q_lora_rank=int(data["q_lora_rank"]) if data.get("q_lora_rank") else None,
            kv_lora_rank=int(need("kv_lora_rank")),
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
            rope_theta=float(data.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(need("max_position_embeddings")),
            rope_scaling=scaling,
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            num_nextn_predict_layers=num_mtp,
            bos_token_id=data.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )
