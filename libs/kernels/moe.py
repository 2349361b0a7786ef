"""DeepSeekMoE's two ops: grouped top-k routing with a selection bias, and the routed experts' SwiGLU.

Routing (V3's "noaux_tc"): sigmoid scores in fp32; the correction bias is added for *selection
only*; experts come in n_group groups, a group scores the sum of its two best biased scores,
the best topk_group groups stay and top_k experts are taken among them; the weights are the
unbiased scores of the chosen experts, normalised to sum to 1 when asked, times the routed
scaling factor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from libs.kernels.linear import linear


def grouped_topk(
    router_logits: Tensor,
    correction_bias: Tensor,
    *,
    n_group: int,
    topk_group: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[Tensor, Tensor]:
    """router_logits: [num_tokens, num_experts] fp32; correction_bias: [num_experts] fp32.

    Returns (weights [num_tokens, top_k] fp32, expert ids [num_tokens, top_k] int64).
    """
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.sigmoid()
    choice = scores + correction_bias  # [num_tokens, num_experts]
    group_scores = choice.view(num_tokens, n_group, -1).topk(2, dim=-1).values.sum(dim=-1)
    kept_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices  # [num_tokens, topk_group]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_mask = group_mask.repeat_interleave(num_experts // n_group, dim=1)  # [num_tokens, num_experts]
    ids = choice.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def routed_experts(
    x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, first_expert: int = 0
) -> Tensor:
    """sum_k weights[t, k] * Expert_{ids[t, k]}(x[t]), each expert down(silu(gate x) * up x).

    x: [num_tokens, hidden]; weights: [num_tokens, top_k] (fp32); ids: [num_tokens, top_k];
    gate_up: [num_experts, 2 * intermediate, hidden] (rows [gate | up]); down: [num_experts,
    hidden, intermediate]. Returns [num_tokens, hidden] in x.dtype. Tokens are grouped by expert
    (one sort), so each expert that any token chose runs once, on its tokens only.
    ``first_expert``: gate_up / down hold experts first_expert .. first_expert + num_experts - 1
    (an expert-parallel rank's share); a pair that chose another expert adds nothing here.
    """
    num_tokens, top_k = ids.shape
    num_experts = gate_up.shape[0]
    flat_ids = ids.flatten() - first_expert
    # Another rank's experts sort last, past every local one, and are never visited.
    flat_ids = flat_ids.masked_fill((flat_ids < 0) | (flat_ids >= num_experts), num_experts)
    order = flat_ids.argsort(stable=True)  # the (token, k) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts + 1)[:num_experts].tolist()
    token_of = order // top_k
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        tokens = token_of[start : start + count]
        start += count
        gate, up = linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        hidden = linear(F.silu(gate) * up, down[expert])  # [count, hidden]
        out.index_add_(0, tokens, hidden.float() * weights.flatten()[pairs, None])
    return out.to(x.dtype)
