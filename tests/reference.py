"""Plain, unpaged references that tests compare the engine against (no scheduler, no KV pages)."""

from __future__ import annotations

import torch
from torch import Tensor

from libs.kernels.attention import causal_attention
from libs.models.attention import SingleSequenceCausalAttention
from libs.models.llama import LlamaForCausalLM
from libs.recipe.chat_template import render_chat
from libs.recipe.tokenizer import IncrementalDetokenizer, Tokenizer


def chat_prompts(tokenizer: Tokenizer, questions: list[str]) -> dict[str, list[int]]:
    """Each question as one user turn in the model's chat template, by id q0, q1, ..."""
    assert tokenizer.chat_template is not None
    return {
        f"q{i}": tokenizer.encode(render_chat(tokenizer.chat_template, [{"role": "user", "content": q}]))
        for i, q in enumerate(questions)
    }


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


@torch.inference_mode()
def greedy_text(
    model: LlamaForCausalLM, tokenizer: Tokenizer, prompt: list[int], max_tokens: int = 12
) -> str:
    """Greedy decode with a GrowingCache (prefill, then one token a step) up to EOS, detokenized."""
    cache, detok, text = GrowingCache(), IncrementalDetokenizer(tokenizer), ""
    step_ids, start = list(prompt), 0
    for _ in range(max_tokens):
        hidden = model(torch.tensor(step_ids), torch.arange(start, start + len(step_ids)), cache)
        next_id = int(model.compute_logits(hidden[-1:])[0].argmax())
        if next_id == tokenizer.eos_token_id:
            break
        text += detok.add([next_id])
        start += len(step_ids)
        step_ids = [next_id]
    return text + detok.flush()
