"""Dense projection y = x W^T (+ b): the plain-torch op, and the weight-major product for fp32 on CPU.

``F.linear`` hands MKL the product as x @ W^T. On the CPU measured here (AMD EPYC, MKL, 2 threads)
that takes a matrix-vector path for one row and a general one for more, and SmolLM2's
projections for 2-4 rows cost twice those for one (bench/kernels.py, "linear"): every step that
verifies drafts, and every small batch, paid it. The same product as (W @ x^T)^T, with the weight
as the left operand, costs for 2-4 rows what one row does, and less than F.linear up to about 64
rows; from about 128 rows (prefill) F.linear is as fast or faster, so larger inputs keep it.
MKL's product there takes the input's rows 8 at a time and a partial last group costs more than a
full one: 12-15 rows cost up to twice what 16 do (59 ms against 82-126 ms for a SmolLM2 forward's
projections). So above 8 rows the input is padded with zero rows to a multiple of 8, whose
outputs are dropped. One row goes in as two (a zero row beside it): MKL's matrix-vector path,
which one row takes even weight-major, streamed the weights at half the speed of the two-column
product on an AMD EPYC (Zen 5) at 2 threads (a forward's projections 31.5 ms against 15.8 ms).
bf16 and CUDA keep ``F.linear`` (no gain measured for bf16 on CPU; cuBLAS picks its own kernel),
except under ``batch_invariant_products`` (``--deterministic``): there a bf16 product on the CPU
runs the extension's ``bf16_linear`` (csrc/cpu_invariant.cpp), whose every output is summed in
one order whatever the number of rows. The matmul library's is not on a CPU with native bf16 math
(one row takes another path than two: about one output in 600 rounds the other way).
Timed over a whole model's weights, as a step streams them: the same small weight timed again
and again stays in cache and measures something else.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from libs.kernels import cpu_ext


def linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x: [..., in_features], weight: [out_features, in_features] -> [..., out_features]."""
    return F.linear(x, weight, bias)


ROW_GROUP = 8  # above this many rows, the weight-major product computes a multiple of it


def linear_weight_major(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """linear_reference's result computed as (W @ x^T)^T, returned contiguous (callers view it)."""
    rows = x.reshape(-1, x.shape[-1])  # [n, in]
    num_rows = rows.shape[0]
    padded_rows = num_rows
    if num_rows == 1:
        padded_rows = 2  # not MKL's matrix-vector path (module docstring)
    elif num_rows > ROW_GROUP:
        padded_rows = -(-num_rows // ROW_GROUP) * ROW_GROUP
    if padded_rows != num_rows:
        padded = rows.new_zeros(padded_rows, rows.shape[1])
        padded[:num_rows] = rows
        rows = padded
    out = (weight @ rows.t())[:, :num_rows].t().contiguous()  # [out, n] -> [n, out]
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


WEIGHT_MAJOR_MAX_ROWS = 64  # above this (prefill chunks), F.linear is as fast or faster


class _Products(threading.local):
    batch_invariant = False


_products = _Products()


@contextlib.contextmanager
def batch_invariant_products(enabled: bool = True) -> Iterator[None]:
    """Within it, on this thread, ``linear`` computes bf16 CPU products batch-invariantly."""
    previous = _products.batch_invariant
    _products.batch_invariant = enabled
    try:
        yield
    finally:
        _products.batch_invariant = previous


def linear_batch_invariant(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """linear_reference's result for bf16 CPU tensors, each output summed in fp32 in an order
    fixed by K alone (equal to the reference to bf16 rounding); the reference elsewhere."""
    ops = cpu_ext.ops() if x.dtype == weight.dtype == torch.bfloat16 and x.is_cpu and weight.is_cpu else None
    if ops is None or x.numel() == 0:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    out: Tensor = ops.bf16_linear(rows if rows.is_contiguous() else rows.contiguous(), weight.contiguous())
    if bias is not None:  # in fp32, then one rounding, as F.linear does
        out += bias
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """linear_reference's result; the weight-major product for fp32 on CPU up to
    WEIGHT_MAJOR_MAX_ROWS rows. The two sum in a different order, so they agree to fp32 rounding,
    not to the bit. Under ``batch_invariant_products``, bf16 goes to ``linear_batch_invariant``."""
    if _products.batch_invariant and x.dtype == torch.bfloat16:
        return linear_batch_invariant(x, weight, bias)
    on_cpu_fp32 = x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
    if on_cpu_fp32 and 0 < x.numel() <= WEIGHT_MAJOR_MAX_ROWS * x.shape[-1]:  # (empty: F.linear)
        return linear_weight_major(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict names) whose forward is ``linear``."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
