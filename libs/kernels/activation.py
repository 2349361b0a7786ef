"""SwiGLU activation: the plain-torch op, flashinfer's fused kernel for CUDA, the CPU extension's.

On CPU, fp32 takes the extension's kernel (csrc/cpu_pointwise.cpp): one op and one pass where the
reference takes three (chunk, silu, multiply), agreeing with it to fp32 rounding (its exp is a
polynomial, ~2e-7 relative). Other torch candidates measured against `F.silu(gate) * up`
(bench/kernels.py): silu into a fresh tensor then an in-place multiply by up, and sigmoid-mul-mul
in place; neither was faster, so the reference is the CPU path for other dtypes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from libs.kernels import cpu_ext


def silu_and_mul_reference(gate_up: Tensor) -> Tensor:
    """silu(gate) * up over a fused projection output.

    gate_up: [..., 2 * ffn], the gate half first then the up half (as one fused gate/up linear
    produces it); returns [..., ffn] in gate_up's dtype.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu_and_mul_reference's result; flashinfer's kernel for half-precision CUDA tensors, the
    CPU extension's for fp32 CPU tensors.

    flashinfer keeps silu(gate) in fp32 for the multiply (one rounding, where torch rounds twice),
    so the two agree to a half-precision step, not to the bit.
    """
    # flashinfer loads 16-byte vectors: the row must be a multiple of 16 bytes.
    aligned = gate_up.shape[-1] * gate_up.element_size() % 16 == 0
    if gate_up.is_cuda and gate_up.dtype in (torch.float16, torch.bfloat16) and aligned:
        from flashinfer.activation import silu_and_mul as flashinfer_silu_and_mul

        out: Tensor = flashinfer_silu_and_mul(gate_up.contiguous())
        return out
    ops = cpu_ext.fp32_ops(gate_up)
    if ops is not None and gate_up.shape[-1] % 2 == 0:
        fused: Tensor = ops.silu_mul(gate_up)
        return fused
    return silu_and_mul_reference(gate_up)
