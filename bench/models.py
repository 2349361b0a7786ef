"""Step time of a DeepSeek-V3-family model against a llama of the same size, through the worker's
forward executor (paged KV, the worker's attention backends), and the MoE routing cost per token.

    python bench/models.py [--size tiny|small] [--threads 2] [--device cpu|cuda] [--quick]

"Same size": the same hidden size, layers, query heads and head width; the llama's MLP is as
wide as the DeepSeek model's dense layers. Per size, prefill of one prompt and batched decodes
over a context, DeepSeek / llama ratio (above 1: DeepSeek is slower). MoE: per token, the grouped
top-k router alone, the routed experts, and the shared expert (a dense SwiGLU of the same width
as one expert), for the DeepSeek model's router over a few batch sizes. The two sides are timed
in alternation, each keeping its best round.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from kernels import best_per_call  # bench/kernels.py: alternating rounds, the best of each

from libs.kernels.moe import routed_experts
from libs.modelfiles.deepseek_config import DeepseekV3Config
from libs.modelfiles.llama_config import LlamaConfig
from libs.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MoE, RoutedExperts
from libs.models.layers import GatedMLP
from libs.models.llama import LlamaForCausalLM
from libs.models.tiny_deepseek import random_deepseek, tiny_config_json
from services.worker.forward_executor import CausalLM, ForwardBatch, ForwardExecutor, ModelShape

BLOCK_SIZE = 16
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},  # the test checkpoint's shape: 64 hidden, 3 layers, 8 experts of 32
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "kv_lora_rank": 128,
        "q_lora_rank": 192,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "vocab_size": 4096,
    },
}


def deepseek_config(size: str) -> DeepseekV3Config:
    return DeepseekV3Config.from_hf_config(
        {**tiny_config_json(), **SIZES[size], "num_nextn_predict_layers": 0}
    )


def matching_llama(config: DeepseekV3Config) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        head_dim=config.qk_head_dim,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False,
    )


DEVICE = torch.device("cpu")  # --device


def _synced(fn: Callable[[], object]) -> Callable[[], object]:
    """fn, then a wait for the device: a GPU step is timed to its end, not to its launch."""
    if DEVICE.type != "cuda":
        return fn

    def synced() -> None:
        fn()
        torch.cuda.synchronize()

    return synced


def prefill_step(model: CausalLM, shape: ModelShape, num_tokens: int) -> Callable[[], object]:
    executor = ForwardExecutor(model, shape, num_tokens // BLOCK_SIZE + 2, BLOCK_SIZE, torch.float32, DEVICE)
    ids = [random.randrange(shape.vocab_size) for _ in range(num_tokens)]
    table = list(range(num_tokens // BLOCK_SIZE + 1))
    batch = ForwardBatch(ids, list(range(num_tokens)), [num_tokens], [0], [table], [num_tokens - 1])
    return _synced(lambda: executor.forward(batch))


def decode_step(model: CausalLM, shape: ModelShape, batch_size: int, context: int) -> Callable[[], object]:
    blocks = -(-(context + 1) // BLOCK_SIZE)
    executor = ForwardExecutor(model, shape, batch_size * blocks, BLOCK_SIZE, torch.float32, DEVICE)
    tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(batch_size)]
    ids = [random.randrange(shape.vocab_size) for _ in range(batch_size)]
    batch = ForwardBatch(
        ids, [context] * batch_size, [1] * batch_size, [context] * batch_size, tables, list(range(batch_size))
    )
    return _synced(lambda: executor.forward(batch))


@torch.inference_mode()
def bench_steps(size: str, rounds: int, round_s: float, quick: bool) -> None:
    config = deepseek_config(size)
    deepseek: DeepseekV3ForCausalLM = random_deepseek(config).to(DEVICE)
    deepseek.reset_rope_cache(DEVICE)
    llama_config = matching_llama(config)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(llama_config).eval().to(DEVICE)
    shapes = {"deepseek": ModelShape.of(config), "llama": ModelShape.of(llama_config)}
    params = {
        "deepseek": sum(p.numel() for p in deepseek.parameters()),
        "llama": sum(p.numel() for p in llama.parameters()),
    }
    sizes = f"DeepSeek {params['deepseek'] / 1e6:.2f}M params, llama {params['llama'] / 1e6:.2f}M"
    print(f"\n## step time, size {size} (fp32): {sizes}")
    kv = {name: shape.kv_spec.bytes_per_token(4) for name, shape in shapes.items()}
    print(f"KV bytes/token: DeepSeek {kv['deepseek']} (MLA latent), llama {kv['llama']} (K and V per head)")
    print(f"{'step':<28} {'llama ms':>10} {'deepseek ms':>12} {'ratio':>7}")
    models: dict[str, CausalLM] = {"deepseek": deepseek, "llama": llama}
    cases: list[tuple[str, Callable[[CausalLM, ModelShape], Callable[[], object]]]] = [
        ("prefill 128", partial(prefill_step, num_tokens=128))
    ]
    if not quick:
        cases.append(("prefill 512", partial(prefill_step, num_tokens=512)))
    for batch_size in (1, 8) if quick else (1, 8, 32):
        cases.append(
            (f"decode x{batch_size} @ ctx 256", partial(decode_step, batch_size=batch_size, context=256))
        )
    for label, make in cases:
        t = best_per_call({name: make(models[name], shapes[name]) for name in models}, rounds, round_s)
        ratio = t["deepseek"] / t["llama"]
        print(f"{label:<28} {t['llama'] * 1e3:>10.2f} {t['deepseek'] * 1e3:>12.2f} {ratio:>7.2f}")


@torch.inference_mode()
def bench_routing(size: str, rounds: int, round_s: float) -> None:
    config = deepseek_config(size)
    model = random_deepseek(config)
    moe = model.layers[config.first_k_dense_replace].mlp
    assert isinstance(moe, DeepseekV3MoE)
    gate, experts = moe.gate, moe.experts
    assert isinstance(experts, RoutedExperts)
    shared = GatedMLP(config.hidden_size, config.moe_intermediate_size, torch.float32, None)
    experts_of = f"{config.n_routed_experts} experts, top-{config.num_experts_per_tok}"
    print(f"\n## MoE cost per token, size {size}: {experts_of}")
    header = (
        f"{'router us/tok':>14} {'routed us/tok':>14} {'one dense expert us/tok':>24} {'routed/dense':>13}"
    )
    print(f"{'tokens':>7} {header}")
    for num_tokens in (1, 8, 64, 512):
        x = torch.randn(num_tokens, config.hidden_size)
        weights, ids = gate(x)
        routed = partial(routed_experts, x, weights, ids, experts.gate_up_proj, experts.down_proj)
        fns: dict[str, Callable[[], object]] = {
            "router": partial(gate, x),
            "routed": routed,
            "dense": partial(shared, x),
        }
        per = {k: v / num_tokens * 1e6 for k, v in best_per_call(fns, rounds, round_s).items()}
        ratio = per["routed"] / per["dense"]
        print(
            f"{num_tokens:>7} {per['router']:>14.2f} {per['routed']:>14.2f}"
            f" {per['dense']:>24.2f} {ratio:>13.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description="DeepSeek-V3 family vs same-size llama: step time, MoE cost."
    )
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="one size (default: both)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the step bench; MoE cost stays on CPU)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny size, short rounds")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    torch.set_num_threads(args.threads)
    random.seed(0)
    print(f"device {DEVICE}, threads {args.threads}, load average {os.getloadavg()[0]:.2f}")
    sizes = ["tiny"] if args.quick else [args.size] if args.size else list(SIZES)
    rounds, round_s = (1, 0.01) if args.quick else (5, 0.2)
    for size in sizes:
        bench_steps(size, rounds, round_s, args.quick)
        bench_routing(size, rounds, round_s)


if __name__ == "__main__":
    main()
