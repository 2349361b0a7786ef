"""Weight-only int8 linear with fp32 activations: y = x @ (w * scales[:, None])^T.

The reference dequantizes and runs F.linear. The fast variant is the CPU extension's
``int8_linear`` (csrc/cpu_ops.cpp), which reads each int8 weight once and converts it in registers:
at one row it reads the weights at ~20 GB/s here where fp32 F.linear reads 4x the bytes at ~14 GB/s
(bench/kernels.py, "int8 linear"). torch's own ``_weight_int8pack_mm`` wants bf16 activations;
with fp32 ones it is over 10x slower, and a CPU without native bf16 math pays for bf16 everywhere.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from libs.kernels import cpu_ext


def int8_linear_reference(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """x: [M, K] fp32; weight: [N, K] int8; scales: [N] fp32 -> [M, N] fp32."""
    return F.linear(x, weight.float() * scales[:, None])


def int8_linear(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """int8_linear_reference's result (to fp32 rounding: the sums run in another order), by the
    extension on CPU tensors when it is built, else the reference."""
    ops = cpu_ext.fp32_ops(x, scales)
    if ops is None:
        return int8_linear_reference(x.float(), weight, scales.float()).to(x.dtype)
    out: Tensor = ops.int8_linear(x if x.is_contiguous() else x.contiguous(), weight, scales)
    return out
