"""Weight formats on SmolLM2: batch-1 decode speed, prefill speed and logit error, against the roofline.

    python bench/weight_formats.py [--threads 2] [--decode-tokens 24] [--rounds 5]
    python bench/weight_formats.py --quick     # smoke run (tests/unit/models/test_bench_weight_formats.py)

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
- quality (--quality-prompts, default 16): teacher-forced top-1 agreement with fp32 over a fixed
  corpus (chat prompts with fp32's greedy answers, and plain passages), at every position and at
  the positions where fp32's top-2 margin is >= 0.5 (not near-ties), with the quantized
  projections through their packed kernels as decode runs them; and each format's greedy answer to
  "What is the capital of France?".
Rounds interleave the formats and keep each one's best, since the machine is shared and noisy.
"int8" runs with the activations the worker gives it on this CPU (fp32 without native bf16 math),
"int8/bf16" with bf16 ones.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prompts import bench_prompts
from torch import Tensor, nn

from libs.kernels.attention import causal_attention
from libs.modelfiles.registry import resolve_model_path
from libs.models.attention import SingleSequenceCausalAttention
from libs.models.gguf_loader import load_llama
from libs.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from libs.models.quant import Int4Linear, Int8Linear, quantize_model
from libs.recipe.chat_template import render_chat
from libs.recipe.tokenizer import Tokenizer
from libs.runtime.settings import resolve_cache_dir
from services.worker.model_loading import load_llama_model

# label -> the worker's --dtype; int8's activations are what the worker runs it with here (fp32
# on a CPU without bf16 math), int8/bf16 is the other choice, bf16 activations.
FORMATS = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8", "int8/bf16": "int8", "int4": "int4"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PASSAGES = (
    "The quick brown fox jumps over the lazy dog. Then the dog woke up and chased the fox across the field.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes it boils at lower heat.",
    "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands of the Caribbean.",
)
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


def load_format(path: Path, cache_dir: Path, label: str) -> LlamaForCausalLM:
    if label == "int8/bf16":
        model = load_llama(path, cache_dir, dtype=torch.bfloat16)
        quantize_model(model, "int8")
        return model
    return load_llama_model(path, cache_dir, FORMATS[label])


MARGIN = 0.5  # fp32's top-1 minus top-2 logit: positions at or above it are not near-ties
CORPUS_ANSWER_TOKENS = 64


@contextlib.contextmanager
def packed_kernels_only() -> Iterator[None]:
    """Every quantized projection through its packed kernel at any token count (as decode steps
    run them), not the dense path a long forward would take."""
    settings = [
        (Int8Linear, "dense_min_tokens"),
        (Int8Linear, "fp32_dense_min_tokens"),
        (Int4Linear, "dense_min_tokens"),
    ]
    saved = [getattr(cls, name) for cls, name in settings]
    for cls, name in settings:
        setattr(cls, name, 1 << 30)
    try:
        yield
    finally:
        for (cls, name), value in zip(settings, saved, strict=True):
            setattr(cls, name, value)


def quality_corpus(model: LlamaForCausalLM, tokenizer: Tokenizer, num_prompts: int) -> list[list[int]]:
    """Chat prompts (rendered as the gateway does) each followed by fp32's greedy answer, and the
    plain-text passages of tests/unit/models/test_quant.py: fixed token sequences to score."""
    assert tokenizer.chat_template is not None
    sequences = []
    for text in bench_prompts(num_prompts):
        prompt = tokenizer.encode(render_chat(tokenizer.chat_template, [{"role": "user", "content": text}]))
        _, logits = decode(model, prompt, None, CORPUS_ANSWER_TOKENS - 1)
        sequences.append(prompt + [int(step.argmax()) for step in logits])
    return sequences + [tokenizer.encode(text) for text in PASSAGES]


def quality(models: dict[str, LlamaForCausalLM], corpus: list[list[int]], tokenizer: Tokenizer) -> None:
    """Teacher-forced top-1 agreement with fp32 at every position of the corpus, and at the positions
    where fp32's top-2 margin is >= MARGIN; and each format's greedy answer to the France question."""

    def scored(model: LlamaForCausalLM) -> Tensor:
        """Logits at every position of every corpus sequence, [positions, vocab]."""
        outs = []
        for ids in corpus:
            hidden = model(torch.tensor(ids), torch.arange(len(ids)), SingleSequenceCausalAttention())
            outs.append(model.compute_logits(hidden))
        return torch.cat(outs)

    with torch.inference_mode(), packed_kernels_only():
        logits = {fmt: scored(model) for fmt, model in models.items()}
    reference = logits["fp32"]
    top2 = reference.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= MARGIN
    print(f"\nteacher-forced top-1 against fp32: {len(corpus)} sequences, {len(reference)} positions, "
          f"{int(clear.sum())} with fp32's top-2 margin >= {MARGIN}")  # fmt: skip
    header = (
        f"{'format':9s} {'top-1 all':>9s} {'top-1 clear':>11s} {'max|dlogit|':>11s} {'mean|dlogit|':>12s}"
    )
    print(f"{header}  France")
    tokenizer_prompt = tokenizer.encode(render_chat(tokenizer.chat_template or "", QUESTION))
    for fmt, ours in logits.items():
        agree = ours.argmax(-1) == reference.argmax(-1)
        delta = (ours - reference).abs()
        _, answer = decode(models[fmt], tokenizer_prompt, None, 12)
        text = tokenizer.decode([int(step.argmax()) for step in answer]).splitlines()[0]
        print(
            f"{fmt:9s} {agree.float().mean().item():9.2%} {agree[clear].float().mean().item():11.2%}"
            f" {delta.max().item():11.3f} {delta.mean().item():12.4f}  {text!r}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--quality-prompts",
        type=int,
        default=16,
        help="chat prompts in the quality corpus (0: no quality check)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 4 tokens, one round, one quality prompt"
    )
    args = parser.parse_args()
    if args.quick:
        args.decode_tokens, args.rounds, args.quality_prompts = 4, 1, 1
    torch.set_num_threads(args.threads)

    path, cache_dir = resolve_model_path("smollm2"), Path(resolve_cache_dir("", os.environ))
    tokenizer = Tokenizer.from_gguf(path, cache_dir)
    assert tokenizer.chat_template is not None
    prompt = tokenizer.encode(render_chat(tokenizer.chat_template, QUESTION))
    models = {fmt: load_format(path, cache_dir, fmt) for fmt in FORMATS}
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
    if args.quality_prompts:
        quality(models, quality_corpus(models["fp32"], tokenizer, args.quality_prompts), tokenizer)


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
    print(f"{'format':9s} {'decode':>8s} {'vs bf16':>7s} {'vs fp32':>7s}", end="")
    print("".join(f" {f'fwd{n}':>8s} {'vs bf16':>7s}" for n in FORWARD_TOKENS))
    for fmt in results:
        rate, fwd = decode_rate[fmt], forward_rate[fmt]
        print(
            f"{fmt:9s} {rate:8.1f} {rate / decode_rate['bf16']:7.2f} {rate / decode_rate['fp32']:7.2f}",
            end="",
        )
        print("".join(f" {fwd[n]:8.0f} {fwd[n] / forward_rate['bf16'][n]:7.2f}" for n in FORWARD_TOKENS))

    print("\naccuracy against fp32 over the decode steps, and batch-1 roofline")
    print(
        f"{'format':9s} {'max|dlogit|':>11s} {'top-1':>6s} {'MB/token':>8s} {'GB/s':>5s} {'of peak':>7s} "
        f"{'matmul ms':>9s} {'GB/s':>5s} {'of peak':>7s} {'matmul share':>12s}"
    )
    for fmt, r in results.items():
        logits = torch.stack(r.logits)
        delta = (logits - reference).abs().max().item()
        top1 = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        weight_bytes = weight_bytes_per_token(models[fmt])
        achieved, matmul_only = weight_bytes * decode_rate[fmt], weight_bytes / r.matmul_s
        print(
            f"{fmt:9s} {delta:11.3f} {top1:6.1%} {weight_bytes / 1e6:8.1f} {achieved / 1e9:5.1f} "
            f"{achieved / bandwidth:7.0%} {r.matmul_s * 1e3:9.2f} {matmul_only / 1e9:5.1f} "
            f"{matmul_only / bandwidth:7.0%} {r.matmul_s * decode_rate[fmt]:12.0%}"
        )


if __name__ == "__main__":
    main()
