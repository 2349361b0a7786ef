"""A step's decoder blocks in one CPU op (csrc/cpu_block.cpp): pre-norm grouped-query attention
over paged KV and a SwiGLU MLP, int8 weights and fp32 activations.

At a few tokens a step, the ~10 torch ops of a block cost more in calls than in arithmetic. The
op runs the same C++ functions as those ops, in the same order, so its result equals the op-by-op
forward's bit for bit; that forward (LlamaForCausalLM's, over the same pages) is its reference.
It takes steps whose every token the paged attention kernel attends (``PagedKernelStep``):
decodes and short rows with context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from libs.kernels import cpu_ext


@dataclass(frozen=True, slots=True)
class PagedKernelStep:
    """The paged attention kernel's arguments for a step whose every token it attends."""

    slot_mapping: Tensor  # [T] int64: the cache slot of each new token
    block_tables: Tensor  # [num_rows, max_blocks] int32
    token_index: Tensor  # [T] int32: every flat token, in order
    token_row: Tensor  # [T] int32
    token_num_keys: Tensor  # [T] int32: keys each token sees (causal)


@dataclass(frozen=True, slots=True)
class BlockWeights:
    """Every block's weights, a list per kind with one tensor per layer; the projections are int8
    [N, K] with fp32 per-row scales [N], the norms fp32 [E]."""

    input_norm: list[Tensor]
    qkv_weight: list[Tensor]  # rows [q | k | v]
    qkv_scales: list[Tensor]
    o_weight: list[Tensor]
    o_scales: list[Tensor]
    post_norm: list[Tensor]
    gate_up_weight: list[Tensor]  # rows [gate | up]
    gate_up_scales: list[Tensor]
    down_weight: list[Tensor]
    down_scales: list[Tensor]
    final_norm: Tensor
    eps: float
    num_heads: int
    num_kv_heads: int


def decoder_blocks(
    hidden: Tensor,
    positions: Tensor,
    weights: BlockWeights,
    cos_sin_cache: Tensor,
    k_caches: Sequence[Tensor],
    v_caches: Sequence[Tensor],
    step: PagedKernelStep,
    scale: float,
) -> Tensor | None:
    """hidden: [T, E] fp32 embeddings, positions: [T] int64 -> the final-normed hidden [T, E],
    with every layer's new keys and values written to its pages; None where the extension is not
    built (the caller runs its op-by-op forward)."""
    ops = cpu_ext.fp32_ops(hidden)
    if ops is None:
        return None
    w = weights
    out: Tensor = ops.decoder_blocks(
        hidden,
        positions,
        w.input_norm,
        w.qkv_weight,
        w.qkv_scales,
        w.o_weight,
        w.o_scales,
        w.post_norm,
        w.gate_up_weight,
        w.gate_up_scales,
        w.down_weight,
        w.down_scales,
        w.final_norm,
        w.eps,
        cos_sin_cache,
        list(k_caches),
        list(v_caches),
        step.slot_mapping,
        step.block_tables,
        step.token_index,
        step.token_row,
        step.token_num_keys,
        scale,
        w.num_heads,
        w.num_kv_heads,
    )
    return out
