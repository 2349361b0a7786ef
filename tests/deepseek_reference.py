"""transformers' DeepseekV3ForCausalLM as the independent reference for the DeepSeek-V3 family.

Built offline from a tiny config (no hub): either random (std 0.08, random selection bias) and
saved with save_pretrained, or loaded from a checkpoint our writer made. fp32, eager experts
(transformers' grouped_mm path is not the reference here).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import transformers

from libs.models.tiny_deepseek import INIT_STD


def hf_from_dir(directory: Path) -> transformers.PreTrainedModel:
    # It reports the MTP layer's tensors as unexpected: it has no MTP module (ours is checked apart).
    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, experts_implementation="eager"
    )
    return model.eval()


def write_hf_random(
    directory: Path, config_json: dict[str, object], seed: int = 0
) -> transformers.PreTrainedModel:
    """A random transformers model of ``config_json``, saved by transformers itself to ``directory``."""
    config = transformers.DeepseekV3Config.from_dict({**config_json, "num_nextn_predict_layers": 0})
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and "rotary" not in name:
                noise = torch.randn_like(tensor) * INIT_STD
                tensor.copy_(1 + noise if "norm" in name else noise)
    model.save_pretrained(directory)
    return model


@torch.no_grad()
def hf_logits(model: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] fp32 logits of one sequence, whole."""
    out = model(torch.tensor([token_ids])).logits[0]
    assert isinstance(out, torch.Tensor)
    return out.float()


def hf_greedy(
    model: transformers.PreTrainedModel, prompt: list[int], max_tokens: int, eos_token_id: int | None
) -> list[int]:
    """transformers' greedy continuation of ``prompt``: up to ``max_tokens`` tokens, ending at EOS."""
    tokens = list(prompt)
    while len(tokens) < len(prompt) + max_tokens:
        tokens.append(int(hf_logits(model, tokens)[-1].argmax()))
        if tokens[-1] == eos_token_id:
            break
    return tokens[len(prompt) :]
