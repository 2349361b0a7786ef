"""Plain, unpaged references that tests compare the engine against (no scheduler, no KV pages)."""

from __future__ import annotations

import torch
from torch import Tensor

from libs.models.attention import SingleSequenceCausalAttention, causal_attention
from libs.models.llama import LlamaForCausalLM


class GrowingCache:
    """AttentionFn for one sequence that keeps each layer's k/v, so decoding feeds one token a step."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if layer_idx in self.kv:
            k_old, v_old = self.kv[layer_idx]
            k, v = torch.cat([k_old, k]), torch.cat([v_old, v])
        self.kv[layer_idx] = (k, v)
        return causal_attention(q, k, v)


@torch.inference_mode()
def reference_greedy(model: LlamaForCausalLM, prompt: list[int], num_tokens: int) -> list[int]:
    """Re-run the whole sequence for every token: no cache, no batching, no paging."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), SingleSequenceCausalAttention())
        tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return tokens[len(prompt) :]
