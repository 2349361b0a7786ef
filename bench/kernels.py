"""Micro-benchmark of the step's ops: each plain-torch reference against the path its dispatcher
takes on CPU, at SmolLM2-135M shapes (hidden 576, 9 query / 3 KV heads of 64, ffn 1536), 2 threads.

    python bench/kernels.py [--threads 2]
    python bench/kernels.py --quick     # smoke run: every op once, 2 layers (a CI test runs it)

One line per op and shape: time per call of the reference and of the fast path, and their ratio
(fast / reference; below 1 is faster). The two are timed in alternation and each keeps its best
round, so a busy neighbour on the machine skews neither side more than the other.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable
from functools import partial

import torch
import torch.nn.functional as F
from random_model import model_config, random_model
from torch import Tensor

from libs.kernels import cpu_ext, paged_attention_torch
from libs.kernels.activation import silu_and_mul, silu_and_mul_reference
from libs.kernels.int8_linear import int8_linear
from libs.kernels.linear import linear, linear_reference
from libs.kernels.paged_attention import (
    PagedAttentionMetadata,
    make_attention_backend,
    paged_attention_reference,
)
from libs.kernels.paged_attention_invariant import BatchInvariantAttentionBackend
from libs.kernels.paged_attention_torch import TorchAttentionBackend
from libs.kernels.rms_norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from libs.kernels.rotary import (
    apply_rotary_interleaved,
    apply_rotary_interleaved_reference,
    apply_rotary_qk,
    rope_cos_sin_cache,
    rotary_rotation,
)
from libs.models.quant import quantize_model
from services.worker.forward_executor import ForwardBatch, ForwardExecutor, ModelShape

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, FFN = 576, 9, 3, 64, 1536
DECODE_BATCHES, PREFILL = (1, 8, 32, 64), 512
DTYPES = (torch.float32, torch.bfloat16)
ROUND_SECONDS, ROUNDS = 0.02, 5


def best_per_call(
    fns: dict[str, Callable[[], object]], rounds: int | None = None, round_seconds: float | None = None
) -> dict[str, float]:
    """Seconds per call of each fn: rounds of ~round_seconds alternate between fns; best round wins
    (by default ROUNDS of ROUND_SECONDS, as this run set them)."""
    rounds = ROUNDS if rounds is None else rounds
    round_seconds = ROUND_SECONDS if round_seconds is None else round_seconds
    calls: dict[str, int] = {}
    for name, fn in fns.items():
        fn()  # warm-up (allocator, lazy init)
        start = time.perf_counter()
        fn()
        calls[name] = max(1, int(round_seconds / max(time.perf_counter() - start, 1e-7)))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls[name])
    return best


def report(
    op: str, shape: str, dtype: torch.dtype, reference: Callable[[], object], fast: Callable[[], object]
) -> None:
    t = best_per_call({"reference": reference, "fast": fast})
    print(
        f"{op:<22} {shape:<28} {_name(dtype):<9}"
        f" {t['reference'] * 1e6:>10.1f} {t['fast'] * 1e6:>10.1f} {t['fast'] / t['reference']:>6.2f}"
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bench_norms(g: torch.Generator) -> None:
    for dtype in DTYPES:
        weight = torch.randn(HIDDEN, generator=g).to(dtype)
        for n in (*DECODE_BATCHES, PREFILL):
            x = torch.randn(n, HIDDEN, generator=g).to(dtype)
            residual = torch.randn(n, HIDDEN, generator=g) * 50  # fp32 residual stream, as llama.py keeps it
            report(
                "rms_norm",
                f"[{n}, {HIDDEN}]",
                dtype,
                partial(rms_norm_reference, x, weight, 1e-5),
                partial(rms_norm, x, weight, 1e-5),
            )
            report(
                "fused_add_rms_norm",
                f"[{n}, {HIDDEN}] + fp32 residual",
                dtype,
                partial(fused_add_rms_norm_reference, x, residual, weight, 1e-5),
                partial(fused_add_rms_norm, x, residual, weight, 1e-5),
            )


def bench_rotary(g: torch.Generator) -> None:
    cache = rope_cos_sin_cache(HEAD_DIM, 8192, 100000.0, torch.float32)
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    for dtype in DTYPES:
        for n in (*DECODE_BATCHES, PREFILL):
            # q as llama.py passes it: a strided view into the fused qkv projection output.
            qkv = torch.randn(n, q_size + 2 * kv_size, generator=g).to(dtype)
            q = qkv[:, :q_size].view(n, NUM_HEADS, HEAD_DIM)
            k = qkv[:, q_size : q_size + kv_size].view(n, NUM_KV_HEADS, HEAD_DIM)
            positions = torch.randint(0, 8192, (n,), generator=g)
            report(
                "rotary (q)",
                f"[{n}, {NUM_HEADS}, {HEAD_DIM}]",
                dtype,
                partial(apply_rotary_interleaved_reference, q, positions, cache),
                partial(apply_rotary_interleaved, q, positions, cache),
            )

            def reference_qk(q: Tensor = q, k: Tensor = k, positions: Tensor = positions) -> object:
                return (
                    apply_rotary_interleaved_reference(q, positions, cache),
                    apply_rotary_interleaved_reference(k, positions, cache),
                )

            report(
                "rotary (q, k)",
                f"[{n}, {NUM_HEADS}+{NUM_KV_HEADS}, {HEAD_DIM}]",
                dtype,
                reference_qk,
                partial(apply_rotary_qk, q, k, positions, cache),
            )
            # As llama.py runs it: the rotation built once per step, shared by every layer.
            report(
                "rotary (q, k) per layer",
                f"[{n}, {NUM_HEADS}+{NUM_KV_HEADS}, {HEAD_DIM}]",
                dtype,
                reference_qk,
                partial(apply_rotary_qk, q, k, positions, cache, rotary_rotation(positions, cache)),
            )


def _silu_and_mul_in_place(gate_up: Tensor) -> Tensor:
    """The candidate that lost (see activation.py): silu into a fresh tensor, then multiply in place."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def bench_activation(g: torch.Generator) -> None:
    for dtype in DTYPES:
        for n in (*DECODE_BATCHES, PREFILL):
            gate_up = torch.randn(n, 2 * FFN, generator=g).to(dtype)
            report(
                "silu_and_mul",
                f"[{n}, {2 * FFN}] (dispatch)",
                dtype,
                partial(silu_and_mul_reference, gate_up),
                partial(silu_and_mul, gate_up),
            )
            report(
                "silu_and_mul",
                f"[{n}, {2 * FFN}] (in-place cand.)",
                dtype,
                partial(silu_and_mul_reference, gate_up),
                partial(_silu_and_mul_in_place, gate_up),
            )


def bench_write_kv(g: torch.Generator) -> None:
    """A step's KV write, as the attention backends make it: two index_copy_ on flat views (the
    torch path) against the CPU extension's one op (what write_kv runs on the CPU)."""
    ops = cpu_ext.ops()
    if ops is None:
        print(f"{'write_kv':<22} skipped: the CPU extension is not built here")
        return
    for dtype in DTYPES:
        caches = [torch.zeros(512, 16, NUM_KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(2)]
        for n in (*DECODE_BATCHES, PREFILL):
            qkv = torch.randn(n, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=g).to(dtype)
            k = qkv[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(
                n, NUM_KV_HEADS, HEAD_DIM
            )
            v = qkv[:, (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM :].view(n, NUM_KV_HEADS, HEAD_DIM)
            slots = torch.randperm(512 * 16, generator=g)[:n]

            def index_copies(
                k: Tensor = k, v: Tensor = v, slots: Tensor = slots, caches: list[Tensor] = caches
            ) -> None:
                caches[0].view(-1, NUM_KV_HEADS, HEAD_DIM).index_copy_(0, slots, k)
                caches[1].view(-1, NUM_KV_HEADS, HEAD_DIM).index_copy_(0, slots, v)

            report(
                "write_kv",
                f"{n} tokens, k/v views",
                dtype,
                index_copies,
                partial(ops.write_kv, k, v, caches[0], caches[1], slots),
            )


# SmolLM2's projections, [out, in]: fused qkv, o, fused gate/up, down (each of 30 layers), tied head
LINEAR_SHAPES = ((HIDDEN + 2 * NUM_KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN), (2 * FFN, HIDDEN),
                 (HIDDEN, FFN))  # fmt: skip
NUM_LAYERS, VOCAB = 30, 49152
LINEAR_ROWS = (1, 2, 4, 8, 12, 16, 28, 32, 64, 128, PREFILL)  # a decode, verifications of 1-7 drafts, batches


Weights = tuple[Tensor, ...]  # what one projection's op takes after its input


def forward_projections(
    op: Callable[..., Tensor],
    layers: list[list[Weights]],
    head: Weights,
    inputs: list[Tensor],
    hidden: Tensor,
) -> None:
    """One forward's projections: ``op(x, *weights)`` for every layer's, then the head's."""
    for weights in layers:
        for x, weight in zip(inputs, weights, strict=True):
            op(x, *weight)
    op(hidden, *head)


def bench_linear(g: torch.Generator) -> None:
    """Every projection of one SmolLM2 forward, in fp32 (bf16 dispatches to F.linear). Each layer
    has weights of its own, so they stream from memory as in a step; one small weight timed over
    and over would stay in cache."""
    layers, head = dense_weights(g)
    compare_projections(
        "linear (a forward's)", LINEAR_ROWS, (linear_reference, layers, head), (linear, layers, head), g
    )


def bench_int8_linear(g: torch.Generator) -> None:
    """The same projections with int8 weights and fp32 activations (the CPU extension's kernel,
    --dtype int8 on a CPU without bf16 math) against fp32 weights through ``linear``: the bytes a
    step reads drop 4x."""
    if cpu_ext.ops() is None:
        print(f"{'int8 linear':<22} skipped: the CPU extension is not built here")
        return
    dense_layers, dense_head = dense_weights(g)
    layers = [[quantized_weight(shape, g) for shape in LINEAR_SHAPES] for _ in range(NUM_LAYERS)]
    head = quantized_weight((VOCAB, HIDDEN), g)
    compare_projections(
        "int8 vs fp32 linear",
        (1, 4, 8, 16, 32),
        (linear, dense_layers, dense_head),
        (int8_linear, layers, head),
        g,
    )
    # From 4 rows, x rounded to int16 (AVX-512 VNNI; elsewhere the same fp32 products). The head
    # takes it here too; the worker's head keeps fp32 activations.
    compare_projections(
        "int8 int16 vs fp32 act",
        (4, 8, 16, 32),
        (int8_linear, layers, head),
        (partial(int8_linear, int16_activations=True), layers, head),
        g,
    )


Projections = tuple[Callable[..., Tensor], list[list[Weights]], Weights]  # (op, each layer's weights, head's)


def compare_projections(
    op: str, row_counts: Iterable[int], reference: Projections, fast: Projections, g: torch.Generator
) -> None:
    """One report row per row count: a forward's projections through ``reference`` against ``fast``."""
    for n in row_counts:
        inputs = [torch.randn(n, shape[1], generator=g) for shape in LINEAR_SHAPES]
        hidden = torch.randn(n, HIDDEN, generator=g)
        report(
            op,
            f"{n} rows, {NUM_LAYERS} layers + head",
            torch.float32,
            partial(forward_projections, *reference, inputs, hidden),
            partial(forward_projections, *fast, inputs, hidden),
        )


def dense_weights(g: torch.Generator) -> tuple[list[list[Weights]], Weights]:
    """Random fp32 weights of every layer's projections, and of the head."""
    layers: list[list[Weights]] = [
        [(torch.randn(shape, generator=g),) for shape in LINEAR_SHAPES] for _ in range(NUM_LAYERS)
    ]
    head: Weights = (torch.randn(VOCAB, HIDDEN, generator=g),)
    return layers, head


def quantized_weight(shape: tuple[int, int], g: torch.Generator) -> Weights:
    """A random int8 weight and its per-row fp32 scales."""
    weight = torch.randint(-127, 128, shape, dtype=torch.int8, generator=g)
    return weight, torch.rand(shape[0], generator=g) / 127


def bench_paged_kernel(dtype: torch.dtype, g: torch.Generator) -> None:
    """Decodes and short verification rows through the CPU extension's paged kernel against the
    gather + mask + SDPA path (TorchAttentionBackend without the kernel)."""
    if cpu_ext.ops() is None:
        print(f"{'paged kernel':<22} skipped: the CPU extension is not built here")
        return
    steps = {
        "1 decode, ctx 200": ([1], [200]),
        "8 decodes, ctx 100-450": ([1] * 8, torch.randint(100, 451, (8,), generator=g).tolist()),
        "32 decodes, ctx 256-1024": ([1] * 32, torch.randint(256, 1025, (32,), generator=g).tolist()),
        "8 verify rows of 4, ctx<=448": ([4] * 8, torch.randint(64, 449, (8,), generator=g).tolist()),
    }
    for label, (query_lens, context_lens) in steps.items():
        meta, (q, k, v, k_cache, v_cache) = attention_step(query_lens, context_lens, dtype, g)
        runs: list[Callable[[], object]] = []
        for use_kernel in (False, True):
            backend = TorchAttentionBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, dtype, use_kernel=use_kernel)
            backend.plan(meta)
            runs.append(partial(backend.forward, q, k, v, k_cache, v_cache))
        report("paged: SDPA vs kernel", label, dtype, runs[0], runs[1])


def attention_step(
    query_lens: list[int],
    context_lens: list[int],
    dtype: torch.dtype,
    g: torch.Generator,
    block_size: int = 16,
) -> tuple[PagedAttentionMetadata, list[Tensor]]:
    """Metadata over shuffled blocks, the step's q/k/v, and random caches just large enough."""
    needed = [-(-(q + c) // block_size) for q, c in zip(query_lens, context_lens, strict=True)]
    pool = torch.randperm(sum(needed), generator=g).tolist()
    tables = [pool[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(needed))]
    meta = PagedAttentionMetadata.build(query_lens, context_lens, tables, block_size)
    n, cache_shape = meta.num_tokens, (len(pool), block_size, NUM_KV_HEADS, HEAD_DIM)
    tensors = [
        torch.randn(n, NUM_HEADS, HEAD_DIM, generator=g),
        torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g),
        torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g),
        torch.randn(cache_shape, generator=g),
        torch.randn(cache_shape, generator=g),
    ]
    return meta, [t.to(dtype) for t in tensors]


def bench_attention(g: torch.Generator) -> None:
    decode_contexts = torch.randint(256, 1025, (32,), generator=g).tolist()
    steps = {
        "32 decodes, ctx 256-1024": ([1] * 32, decode_contexts),
        "prefill 512": ([PREFILL], [0]),
        "prefill 512 after 512": ([PREFILL], [512]),
    }
    for dtype in DTYPES:
        backend = make_attention_backend(torch.device("cpu"), NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, dtype)
        for label, (query_lens, context_lens) in steps.items():
            meta, (q, k, v, k_cache, v_cache) = attention_step(query_lens, context_lens, dtype, g)
            backend.plan(meta)  # once per step; the layers then share it
            report(
                "paged_attention",
                label,
                dtype,
                partial(paged_attention_reference, q, k_cache, v_cache, meta),
                partial(backend.forward, q, k, v, k_cache, v_cache),
            )
        meta, _ = attention_step([1] * 32, decode_contexts, dtype, g)
        t = best_per_call({"plan": partial(backend.plan, meta)})["plan"]
        print(f"{'  its plan()':<22} {'once per step':<28} {_name(dtype):<9} {'':>10} {t * 1e6:>10.1f}")
        bench_decode_groups(dtype, g)
        bench_short_rows(dtype, g)
        bench_paged_kernel(dtype, g)


def compare_settings(
    label: str,
    query_lens: list[int],
    contexts: list[int],
    dtype: torch.dtype,
    g: torch.Generator,
    setting: str,
    values: tuple[tuple[str, int], tuple[str, int]],
    what: str,
) -> None:
    """One step planned under two values of a module setting of paged_attention_torch (the
    baseline first), each forward timed; prints both and their ratio."""
    meta, (q, k, v, k_cache, v_cache) = attention_step(query_lens, contexts, dtype, g)
    backends: dict[str, Callable[[], object]] = {}
    for name, value in values:
        backend = TorchAttentionBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, dtype)  # the SDPA paths
        saved = getattr(paged_attention_torch, setting)
        setattr(paged_attention_torch, setting, value)
        try:
            backend.plan(meta)
        finally:
            setattr(paged_attention_torch, setting, saved)
        backends[name] = partial(backend.forward, q, k, v, k_cache, v_cache)
    t = best_per_call(backends)
    (base, _), (fast, _) = values
    print(
        f"{'paged_attention':<22} {label:<28} {_name(dtype):<9}"
        f" {t[base] * 1e6:>10.1f} {t[fast] * 1e6:>10.1f} {t[fast] / t[base]:>6.2f}  ({what})"
    )


def bench_short_rows(dtype: torch.dtype, g: torch.Generator) -> None:
    """32 decodes each verifying 5 drafted tokens (rows of 6 queries over 64-448 cached tokens,
    inside MAX_SHORT_KEYS): batched like decodes (the backend's way) against one SDPA per row
    (the baseline: the path of every multi-token row before, MAX_SHORT_QUERY_LEN = 0)."""
    contexts = torch.randint(64, 449, (32,), generator=g).tolist()
    values = (("per row", 0), ("batched", paged_attention_torch.MAX_SHORT_QUERY_LEN))
    compare_settings(
        "32 verify rows of 6, ctx<=448", [6] * 32, contexts, dtype, g,
        "MAX_SHORT_QUERY_LEN", values, "one SDPA per row vs batched",
    )  # fmt: skip


def bench_decode_groups(dtype: torch.dtype, g: torch.Generator) -> None:
    """16 short decodes beside one 4k-token row (a P/D handoff's first decode steps): decode rows
    grouped by length (the backend's rule) against one group padded to the longest row (the
    baseline: DECODE_GROUP_SLACK_TOKENS unbounded)."""
    contexts = [*torch.randint(32, 257, (16,), generator=g).tolist(), 4000]
    values = (("one group", 1 << 30), ("grouped", paged_attention_torch.DECODE_GROUP_SLACK_TOKENS))
    compare_settings(
        "16 decodes + 1 at 4000", [1] * 17, contexts, dtype, g,
        "DECODE_GROUP_SLACK_TOKENS", values, "one padded group vs grouped by length",
    )  # fmt: skip


def bench_batch_invariant(g: torch.Generator) -> None:
    """The batch-invariant backend (--deterministic) against the SDPA backend (the baseline), in
    bf16, its only dtype in service: what the flag costs attention, on the extension's kernel (the
    worker's path) and on the chunked torch products (the fallback where the extension is absent)."""
    decodes = [100 + 50 * i for i in range(8)]
    steps = {
        "1 decode, ctx 200": ([1], [200]),
        "8 decodes, ctx 100-450": ([1] * 8, decodes),
        "prefill 300": ([300], [0]),
        "chunk 24 after 200 + 7 dec": ([24] + [1] * 7, [200, *decodes[:7]]),
    }
    heads = (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16)
    for label, (query_lens, contexts) in steps.items():
        meta, (q, k, v, k_cache, v_cache) = attention_step(query_lens, contexts, torch.bfloat16, g)
        backends: dict[str, Callable[[], object]] = {}
        sdpa = make_attention_backend(torch.device("cpu"), *heads)
        kernel = BatchInvariantAttentionBackend(*heads, use_kernel=True)
        chunked = BatchInvariantAttentionBackend(*heads, use_kernel=False)
        for name, backend in (("sdpa", sdpa), ("kernel", kernel), ("chunked", chunked)):
            backend.plan(meta)
            backends[name] = partial(backend.forward, q, k, v, k_cache, v_cache)
        t = best_per_call(backends)
        for name in ("kernel", "chunked"):
            print(
                f"{'paged_attention':<22} {label:<28} {'bf16':<9} {t['sdpa'] * 1e6:>10.1f}"
                f" {t[name] * 1e6:>10.1f} {t[name] / t['sdpa']:>6.2f}"
                f"  (default backend vs batch-invariant {name})"
            )


def bench_decoder_blocks(g: torch.Generator) -> None:
    """A decode step of a SmolLM2-shaped int8 model (30 layers, random weights) through the
    ForwardExecutor: op by op (reference) against the fused decoder_blocks op, rows of 100
    tokens' context. The LM head is outside both (the executor is asked for no logits)."""
    if cpu_ext.ops() is None:
        print(f"{'decoder_blocks':<22} skipped: the CPU extension is not built here")
        return
    config = model_config("smollm2")
    model = random_model(config, torch.float32, "cpu")
    quantize_model(model, "int8")
    block_size, context = 16, 100
    for num_rows in (1, 8):
        blocks_per_row = context // block_size + 1
        executors = {
            fuse: ForwardExecutor(
                model,
                ModelShape.of(config),
                num_rows * blocks_per_row,
                block_size,
                torch.float32,
                fuse_blocks=fuse,
            )
            for fuse in (False, True)
        }
        batch = ForwardBatch(
            input_ids=[7] * num_rows,
            positions=[context] * num_rows,
            query_lens=[1] * num_rows,
            context_lens=[context] * num_rows,
            block_tables=[list(range(r * blocks_per_row, (r + 1) * blocks_per_row)) for r in range(num_rows)],
            logits_index=[],
        )
        report(
            "decoder_blocks",
            f"{num_rows} decode rows x {context} keys",
            torch.float32,
            partial(executors[False].forward, batch),
            partial(executors[True].forward, batch),
        )
    assert executors[True].num_fused_steps > 0


def main() -> None:
    parser = argparse.ArgumentParser(description="Reference vs fast path of each kernel op.")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--quick", action="store_true", help="every op once, projections over 2 layers")
    args = parser.parse_args()
    if args.quick:
        global ROUNDS, ROUND_SECONDS, NUM_LAYERS
        ROUNDS, ROUND_SECONDS, NUM_LAYERS = 1, 0.0, 2
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; times in microseconds per call")
    print(f"{'op':<22} {'shape':<28} {'dtype':<9} {'reference':>10} {'fast':>10} {'ratio':>6}")
    with torch.inference_mode():
        bench_norms(g)
        bench_rotary(g)
        bench_activation(g)
        bench_write_kv(g)
        bench_linear(g)
        bench_int8_linear(g)
        bench_attention(g)
        bench_batch_invariant(g)
        bench_decoder_blocks(g)


if __name__ == "__main__":
    main()
