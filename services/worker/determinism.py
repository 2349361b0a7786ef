"""``--deterministic``: whether this worker can give a request the same tokens whatever else is in
its batch, however its prompt was chunked and whether it was preempted, and if not, why.

A token's computation is batch-invariant when every op computes a row from that row alone in a
fixed order. Elementwise ops, the fp32 norms and the sampler (each row's own draws from its seed
and position) are; attention is made so by the batch-invariant backend
(libs/kernels/paged_attention_invariant.py); the products of the projections are whatever the
matmul library does, except that bf16 CPU products run the extension's batch-invariant kernel
(``batch_invariant_products``, libs/kernels/linear.py). The probe here runs the model's own
projections, norms, MLP and head on rows alone and within larger batches and compares the bits:
a library or format whose kernel changes with the number of rows is refused at start, with that
reason, instead of serving "deterministic" output that is not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor

from libs.kernels.linear import batch_invariant_products
from libs.kernels.paged_attention import PagedAttentionMetadata
from libs.kernels.paged_attention_invariant import BatchInvariantAttentionBackend
from libs.kvstore.kv_spec import MLA, KVSpec
from libs.models.llama import LlamaDecoderLayer, LlamaForCausalLM

# Row slices of a 256-row batch (the head's: 37, it is large) compared with the same rows computed
# alone or in a smaller batch: one row (a matrix-vector path), a few, a partial tile, the tail.
PROBE_ROWS = 256
HEAD_PROBE_ROWS = 37
PROBE_SLICES = ((0, 1), (0, 2), (3, 4), (5, 13), (8, 25), (36, 37), (40, 140), (100, 256))
# ... and each of the first rows alone: a bf16 product that sums in another order for one row
# than for a batch shows only where the two round to different bf16 values, about one output in
# 600 on SmolLM2's widths, so a probe of a row or two passes by chance (measured: it did).
PROBE_SINGLE_ROWS = 32


def refusal(device: torch.device, dtype: torch.dtype, kv_spec: KVSpec, speculative_method: str) -> str | None:
    """Why ``--deterministic`` cannot hold for this worker's setup, before any probe (None: it may)."""
    if device.type != "cpu":
        return (
            f"batch-invariant kernels are CPU-only here; on {device.type} the matmul library picks "
            "its kernel by batch size"
        )
    if dtype != torch.bfloat16:
        return (
            f"it needs bfloat16 activations (got {dtype}): on the CPU an fp32 product of one row takes "
            "a matrix-vector path that sums in another order than a batch's"
        )
    if kv_spec.kind == MLA:
        return "the MLA attention backend is not batch-invariant"
    if speculative_method == "mtp":
        return "MTP drafting runs a second model that is not checked for batch invariance"
    return None


def probe(model: LlamaForCausalLM, dtype: torch.dtype) -> str | None:
    """Run the model's first block's projections, MLP and norms, its final norm and its head on
    random rows, alone and in batches; the first op whose rows differ, as a reason (None: none)."""
    ops = _probed_ops(model)
    generator = torch.Generator().manual_seed(0)
    singles = tuple((i, i + 1) for i in range(PROBE_SINGLE_ROWS))
    for name, op, width in ops:
        num_rows = HEAD_PROBE_ROWS if name == "compute_logits" else PROBE_ROWS
        x = torch.randn(num_rows, width, generator=generator).to(dtype)
        with torch.inference_mode(), batch_invariant_products():
            whole = op(x)
            for start, end in PROBE_SLICES + singles:
                if end <= num_rows and not torch.equal(op(x[start:end]), whole[start:end]):
                    return (
                        f"{name} gives rows {start}..{end - 1} other bits alone than in a batch of "
                        f"{num_rows} on this machine (its matmul kernel depends on the batch size)"
                    )
    config = model.config
    return _attention_probe(config.num_attention_heads, config.num_key_value_heads, config.head_dim, dtype)


def _attention_probe(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> str | None:
    """The batch-invariant attention's products on this machine: a 100-token sequence's last
    position as a lone decode, and as the last query of a 4-token row beside a 300-token decode."""
    backend = BatchInvariantAttentionBackend(num_heads, num_kv_heads, head_dim, dtype, use_kernel=True)
    generator = torch.Generator().manual_seed(1)
    cache_shape = (32, 16, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(cache_shape, generator=generator).to(dtype) for _ in range(2))
    q = torch.randn(5, num_heads, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(5, num_kv_heads, head_dim, generator=generator).to(dtype) for _ in range(2))
    a_table, b_table = list(range(7)), list(range(7, 26))
    with torch.inference_mode():
        # A's positions 96..99 (q[0..3]) as one row, beside B's decode at 299 (q[4]) ...
        backend.plan(PagedAttentionMetadata.build([4, 1], [96, 299], [a_table, b_table], 16))
        in_batch = backend.forward(q, k, v, k_cache, v_cache)[3]
        # ... then position 99 again, alone, over the keys that step wrote.
        backend.plan(PagedAttentionMetadata.build([1], [99], [a_table], 16))
        alone = backend.forward(q[3:4], k[3:4], v[3:4], k_cache, v_cache)[0]
    if not torch.equal(alone, in_batch):
        return "attention gives a query other bits alone than in a batch (its products depend on the shape)"
    return None


def _probed_ops(model: LlamaForCausalLM) -> list[tuple[str, Callable[[Tensor], Tensor], int]]:
    """(name, op over [rows, width] inputs, width) for each op a token's rows pass through."""
    hidden = model.config.hidden_size
    layer = cast(LlamaDecoderLayer, model.layers[0])
    ops: list[tuple[str, Callable[[Tensor], Tensor], int]] = []
    for name, module in layer.named_modules():
        if hasattr(module, "in_features"):  # nn.Linear and the packed int8 / int4 layers
            ops.append((f"layers.0.{name}", module, int(module.in_features)))
    ops.append(("layers.0.mlp", layer.mlp, hidden))
    ops.append(("layers.0.input_layernorm", layer.input_layernorm, hidden))

    def add_and_norm(x: Tensor) -> Tensor:
        normed, residual = model.norm.add_and_norm(x, x.float())
        return torch.cat([normed.float(), residual], dim=-1)

    ops.append(("norm.add_and_norm", add_and_norm, hidden))
    ops.append(("compute_logits", model.compute_logits, hidden))
    return ops
