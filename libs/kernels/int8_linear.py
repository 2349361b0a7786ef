"""Weight-only int8 linear with fp32 activations: y = x @ (w * scales[:, None])^T.

The reference dequantizes and runs F.linear. The fast variant is the CPU extension's
``int8_linear`` (csrc/cpu_int8.cpp), which reads each int8 weight once and converts it in
registers: at one row it reads the weights near the core's read bandwidth, where fp32 F.linear
reads 4x the bytes (bench/kernels.py, "int8 linear"). torch's own ``_weight_int8pack_mm`` wants
bf16 activations; with fp32 ones it is over 10x slower, and a CPU without native bf16 math pays
for bf16 everywhere.

From 4 rows a product is bound by arithmetic, not bytes. With ``int16_activations`` on a CPU with
AVX-512 VNNI the extension rounds each row of x to int16 (its own scale, max |x| / 32767) and
multiplies int16 pairs into int32 sums, exact per lane, that meet in fp32: 1.2-1.3x the fp32
products, at a rounding of x finer than bf16's (``int8_linear_int16_reference`` is that
arithmetic in torch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from libs.kernels import cpu_ext

INT16_MAX = 32767
INT16_MIN_ROWS = 4  # the extension's INT16_MIN_ROWS: fewer rows keep fp32 products
INT16_BLOCK = 32  # the extension rounds x's first K // 32 * 32 columns; the rest stay fp32
INT16_MIN_TOP = 1e-30  # the extension's I16_MIN_TOP: rows this small keep the fp32 product


def int8_linear_reference(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """x: [M, K] fp32; weight: [N, K] int8; scales: [N] fp32 -> [M, N] fp32."""
    return F.linear(x, weight.float() * scales[:, None])


def int8_linear_int16_reference(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """The int16-activation product, its sums in float64: each row of x's first K // 32 * 32
    columns rounded (half to even) to int16 as the kernel rounds it, x * (32767 / max |row|) in
    fp32, then scaled back by max |row| / 32767; the other columns as they are. A row whose
    largest value is under INT16_MIN_TOP, or that is not finite, keeps the plain product."""
    k_int = x.shape[1] // INT16_BLOCK * INT16_BLOCK
    top = x.float().abs().amax(dim=1, keepdim=True)
    plain = ~torch.isfinite(x.float()).all(dim=1, keepdim=True) | (top < INT16_MIN_TOP)
    top = torch.where(plain, torch.ones_like(top), top)
    q = torch.round(x[:, :k_int].float() * (INT16_MAX / top)).clamp(-INT16_MAX, INT16_MAX).double()
    w64 = weight.double()
    out = (q @ w64[:, :k_int].T) * (top / INT16_MAX).double() + x[:, k_int:].double() @ w64[:, k_int:].T
    out = torch.where(plain, x.double() @ w64.T, out)
    return (out * scales.double()).float()


def int8_linear(x: Tensor, weight: Tensor, scales: Tensor, int16_activations: bool = False) -> Tensor:
    """int8_linear_reference's result (to fp32 rounding: the sums run in another order), by the
    extension on CPU tensors when it is built, else the reference. ``int16_activations``: from
    INT16_MIN_ROWS rows, on a CPU with AVX-512 VNNI, x may be rounded to int16 (see the module
    docstring); elsewhere it changes nothing."""
    ops = cpu_ext.fp32_ops(x, scales)
    if ops is None:
        return int8_linear_reference(x.float(), weight, scales.float()).to(x.dtype)
    contiguous = x if x.is_contiguous() else x.contiguous()
    out: Tensor = ops.int8_linear(contiguous, weight, scales, int16_activations)
    return out


def int16_products() -> bool:
    """Whether the extension is built here with the int16-activation path (AVX-512 VNNI)."""
    ops = cpu_ext.ops()
    return ops is not None and bool(ops.int8_int16_products())
