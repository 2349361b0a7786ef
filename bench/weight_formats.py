"""Weight formats on SmolLM2: batch-1 decode speed, prefill speed and logit error, against the roofline.

    python bench/weight_formats.py [--threads 2] [--decode-tokens 24] [--rounds 5]

For fp32, bf16, int8 and int4 (libs.models.quant) in one run:
- decode tokens/s at batch 1 (a plain loop over the model forward with a contiguous KV cache), with
  ratios against bf16 and fp32; and tokens/s of one 32-token forward (the matmul shape of a 32-way
  decode batch) and of one 512-token prefill, against bf16;
- the logits' max |delta| and top-1 agreement against fp32 over the decode steps: every format is fed
  the tokens fp32 chose greedily, so each step compares the same context;
- the roofline: read bandwidth measured here (best of a few sums over a 256 MiB tensor), the weight
  bytes one decode step reads, and achieved bytes/s (= bytes/token x tokens/s) as a share of it; and
  the same for the weight matmuls alone (every projection and the LM head on one token, back to
  back), which says how much of a decode step is the weights and how much everything else.
Rounds interleave the formats and keep each one's best, since the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from libs.kernels.attention import causal_attention
from libs.modelfiles.registry import resolve_model_path
from libs.models.attention import SingleSequenceCausalAttention
from libs.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from libs.models.quant import Int4Linear, Int8Linear
from libs.recipe.chat_template import render_chat
from libs.recipe.tokenizer import Tokenizer
from libs.runtime.settings import resolve_cache_dir
from services.worker.main import load_llama_model

FORMATS = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8", "int4": "int4"}  # label -> --dtype
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
FORWARD_TOKENS = (32, 512)


class ContiguousKV:
    """AttentionFn for one sequence: each layer's k/v in a preallocated [max_len, kv_heads, head_dim]."""

    def __init__(self, model: LlamaForCausalLM, max_len: int) -> None:
        cfg = model.config
        shape = (cfg.num_hidden_layers, max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype)
        self.v = torch.zeros(shape, dtype=model.dtype)
        self.length = 0  # tokens stored by earlier steps; the caller advances it after each forward

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        end = self.length + k.shape[0]
        self.k[layer_idx, self.length : end] = k
        self.v[layer_idx, self.length : end] = v
        return causal_attention(q, self.k[layer_idx, :end], self.v[layer_idx, :end])


@dataclass
class Result:
    decode_s: float = float("inf")  # best time for the decode loop
    matmul_s: float = float("inf")  # best time for one token's weight matmuls alone
    forward_s: dict[int, float] = field(default_factory=dict)  # tokens -> best time of one forward
    logits: list[Tensor] = field(default_factory=list)  # [vocab] per decode step, from the last round


def decode(
    model: LlamaForCausalLM, prompt: list[int], feed: list[int] | None, steps: int
) -> tuple[float, list[Tensor]]:
    """Prefill `prompt`, then `steps` one-token steps fed `feed` (greedy if None): (seconds, logits)."""
    cache = ContiguousKV(model, len(prompt) + steps + 1)
    logits: list[Tensor] = []
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), cache)
        cache.length = len(prompt)
        logits.append(model.compute_logits(hidden[-1:])[0])
        start = time.perf_counter()
        for i in range(steps):
            token = feed[i] if feed is not None else int(logits[-1].argmax())
            hidden = model(torch.tensor([token]), torch.tensor([cache.length]), cache)
            cache.length += 1
            logits.append(model.compute_logits(hidden)[0])
        return time.perf_counter() - start, logits


def forward_seconds(model: LlamaForCausalLM, num_tokens: int) -> float:
    """One forward over `num_tokens` new tokens plus the last one's logits, as a prefill does."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), generator=generator)
    with torch.inference_mode():
        start = time.perf_counter()
        hidden = model(ids, torch.arange(num_tokens), SingleSequenceCausalAttention())
        model.compute_logits(hidden[-1:])
        return time.perf_counter() - start


def matmul_seconds(model: LlamaForCausalLM) -> float:
    """One token through every projection and the LM head, nothing else (weights stream from memory:
    even int4 SmolLM2 is ~3x the last-level cache)."""
    projections: list[nn.Linear | Int8Linear | Int4Linear] = []
    for layer in model.layers:
        assert isinstance(layer, LlamaDecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            assert isinstance(proj, nn.Linear | Int8Linear | Int4Linear)
            projections.append(proj)
    inputs = [torch.randn(1, p.in_features, dtype=model.dtype) for p in projections]
    hidden = torch.randn(1, model.config.hidden_size, dtype=model.dtype)
    with torch.inference_mode():
        start = time.perf_counter()
        for projection, x in zip(projections, inputs, strict=True):
            projection(x)
        model.compute_logits(hidden)
        return time.perf_counter() - start


def read_bandwidth(rounds: int = 5) -> float:
    """Bytes/s of the best full read of a 256 MiB fp32 tensor (a sum: reads, no writes)."""
    data = torch.ones(64 * 2**20)
    data.sum()  # first touch
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * data.element_size() / best


def weight_bytes_per_token(model: LlamaForCausalLM) -> int:
    """Bytes of weights one decode step reads: everything but the embedding table, which is looked up
    one row at a time, unless the LM head is tied to it and so reads all of it."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    skip = {"embed_tokens.weight", "cos_sin_cache"}
    total = sum(t.nbytes for name, t in tensors.items() if name not in skip)
    return total + (model.embed_tokens.weight.nbytes if model.lm_head is None else 0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    path, cache_dir = resolve_model_path("smollm2"), Path(resolve_cache_dir("", os.environ))
    tokenizer = Tokenizer.from_gguf(path, cache_dir)
    assert tokenizer.chat_template is not None
    prompt = tokenizer.encode(render_chat(tokenizer.chat_template, QUESTION))
    models = {fmt: load_llama_model(path, cache_dir, dtype) for fmt, dtype in FORMATS.items()}
    _, ref_logits = decode(models["fp32"], prompt, None, args.decode_tokens)
    feed = [int(step.argmax()) for step in ref_logits[:-1]]  # fp32's greedy tokens

    bandwidth = read_bandwidth()
    results = {fmt: Result() for fmt in FORMATS}
    for round_idx in range(args.rounds):
        print(f"round {round_idx + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for fmt, model in models.items():
            seconds, logits = decode(model, prompt, feed, args.decode_tokens)
            results[fmt].decode_s = min(results[fmt].decode_s, seconds)
            results[fmt].logits = logits
            results[fmt].matmul_s = min(results[fmt].matmul_s, matmul_seconds(model))
            best = results[fmt].forward_s
            for num_tokens in FORWARD_TOKENS:
                seconds = forward_seconds(model, num_tokens)
                best[num_tokens] = min(best.get(num_tokens, seconds), seconds)
    bandwidth = max(bandwidth, read_bandwidth())  # measured again after the runs; keep the better
    report(models, results, ref_logits, bandwidth, args)


def report(
    models: dict[str, LlamaForCausalLM],
    results: dict[str, Result],
    ref_logits: list[Tensor],
    bandwidth: float,
    args: argparse.Namespace,
) -> None:
    steps, rounds = args.decode_tokens, args.rounds
    print(f"SmolLM2-135M, {args.threads} threads, batch-1 decode of {steps} tokens, best of {rounds} rounds")
    print(f"measured read bandwidth: {bandwidth / 1e9:.1f} GB/s")
    decode_rate = {fmt: steps / r.decode_s for fmt, r in results.items()}
    forward_rate = {fmt: {n: n / s for n, s in r.forward_s.items()} for fmt, r in results.items()}
    reference = torch.stack(ref_logits)  # [steps + 1, vocab]

    print("\nspeed (tok/s, and ratio against bf16 / fp32)")
    print(f"{'format':6s} {'decode':>8s} {'vs bf16':>7s} {'vs fp32':>7s}", end="")
    print("".join(f" {f'fwd{n}':>8s} {'vs bf16':>7s}" for n in FORWARD_TOKENS))
    for fmt in results:
        rate, fwd = decode_rate[fmt], forward_rate[fmt]
        print(
            f"{fmt:6s} {rate:8.1f} {rate / decode_rate['bf16']:7.2f} {rate / decode_rate['fp32']:7.2f}",
            end="",
        )
        print("".join(f" {fwd[n]:8.0f} {fwd[n] / forward_rate['bf16'][n]:7.2f}" for n in FORWARD_TOKENS))

    print("\naccuracy against fp32 over the decode steps, and batch-1 roofline")
    print(
        f"{'format':6s} {'max|dlogit|':>11s} {'top-1':>6s} {'MB/token':>8s} {'GB/s':>5s} {'of peak':>7s} "
        f"{'matmul ms':>9s} {'GB/s':>5s} {'of peak':>7s} {'matmul share':>12s}"
    )
    for fmt, r in results.items():
        logits = torch.stack(r.logits)
        delta = (logits - reference).abs().max().item()
        top1 = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        weight_bytes = weight_bytes_per_token(models[fmt])
        achieved, matmul_only = weight_bytes * decode_rate[fmt], weight_bytes / r.matmul_s
        print(
            f"{fmt:6s} {delta:11.3f} {top1:6.1%} {weight_bytes / 1e6:8.1f} {achieved / 1e9:5.1f} "
            f"{achieved / bandwidth:7.0%} {r.matmul_s * 1e3:9.2f} {matmul_only / 1e9:5.1f} "
            f"{matmul_only / bandwidth:7.0%} {r.matmul_s * decode_rate[fmt]:12.0%}"
        )


if __name__ == "__main__":
    main()
