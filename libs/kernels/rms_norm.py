"""RMSNorm, plain and fused with the residual add: plain-torch references and the dispatching ops.

`rms_norm` picks flashinfer's kernel for CUDA tensors where its semantics match (fp16/bf16, one
dtype throughout), the CPU extension's (csrc/cpu_pointwise.cpp) for fp32 CPU tensors, else the
torch fast path, which runs on any device. `fused_add_rms_norm` takes the CPU extension's kernel
for fp32 CPU tensors, else the torch fast path: flashinfer's fused add+norm keeps the sum in the
input's half dtype, while llama.py carries the residual stream in fp32 (a design choice, see
LlamaDecoderLayer), so its kernel would never apply to the model. The CPU kernel is one op where
the torch path takes seven (~40 us against ~4 at one token); it sums the squares in another order,
so it agrees with the reference to fp32 rounding, not to the bit.

The torch fast path computes what the reference computes, bit for bit, with fewer full-size
temporaries (two where the reference makes up to four, the rest in place); fresh large temporaries
cost page faults on first touch, so the gain grows with the token count. Torch's own `F.rms_norm` is no
help on CPU: in torch 2.13 its "fused" CPU route runs the same pow/mean/rsqrt/mul chain, and with
mixed dtypes (llama.py's fp32 residual under bf16 weights) it falls back to the unfused composite
with a warning. bench/kernels.py has the numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from libs.kernels import cpu_ext

_HALF = (torch.float16, torch.bfloat16)
_FAST = (torch.float32, *_HALF)  # dtypes vector_norm can accumulate in fp32 without narrowing


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Root-mean-square norm over the last dim, computed in fp32 and cast back to x.dtype.

    x: [..., hidden]; weight: [hidden]; returns [..., hidden].
    """
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    normed = x32 * torch.rsqrt(variance + eps)
    # Apply the weight in fp32 too so a bf16 model rounds once, at the end.
    return (normed * weight.float()).to(x.dtype)


def fused_add_rms_norm_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """`residual + x`, and its norm: the pre-norm step between two sub-layers.

    x, residual: [..., hidden]; weight: [hidden]. Returns (normed in x.dtype, new_residual in
    residual.dtype); the inputs are not modified. The sum is taken in fp32, so a caller that keeps
    the residual stream in fp32 under a bf16 model loses nothing in the add (llama models carry
    outlier channels in the thousands, where bf16's step is 8-128).
    """
    new_residual = (x.float() + residual.float()).to(residual.dtype)
    return rms_norm_reference(new_residual, weight, eps).to(x.dtype), new_residual


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """rms_norm_reference's result (fp32 math, one rounding to x.dtype), by the fastest route."""
    if x.is_cuda and x.dtype in _HALF and weight.dtype == x.dtype:
        return _rms_norm_flashinfer(x, weight, eps)
    ops = cpu_ext.fp32_ops(x, weight)
    if ops is not None:
        out: Tensor = ops.rms_norm(x, weight, eps)
        return out
    return _normed(x, weight, eps, x.dtype)


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """fused_add_rms_norm_reference's result by the fastest route; the inputs are not modified."""
    ops = cpu_ext.fp32_ops(x, residual, weight)
    if ops is not None and x.shape == residual.shape:
        normed, new_residual = ops.add_rms_norm(x, residual, weight, eps)
        return normed, new_residual
    if torch.result_type(x, residual) != residual.dtype:
        # e.g. an fp32 x onto a bf16 residual: the reference adds in fp32 then rounds; keep that.
        return fused_add_rms_norm_reference(x, residual, weight, eps)
    # Same value as the reference's fp32 add: for an fp32 residual x is upcast exactly, and for a
    # half residual torch adds in fp32 and rounds once to residual.dtype.
    new_residual = residual + x
    return _normed(new_residual, weight, eps, x.dtype), new_residual


def _normed(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    """x / rms(x) * weight in fp32, rounded once to out_dtype. x: [..., hidden]; weight: [hidden]."""
    if x.dtype not in _FAST:
        return rms_norm_reference(x, weight, eps).to(out_dtype)
    # The variance exactly as the reference takes it (a mean of fp32 squares): a bf16 model sits on
    # near-ties in its logits, and a norm that differs by an ulp flips SmolLM2's greedy answer.
    x32 = x.float()
    inv_rms = x32.square().mean(dim=-1, keepdim=True).add_(eps).rsqrt_()  # [..., 1]
    out = x32.mul_(inv_rms) if x32 is not x else x * inv_rms
    out.mul_(weight)  # in fp32, like the reference's weight.float()
    return out.to(out_dtype)


def _rms_norm_flashinfer(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    from flashinfer.norm import rmsnorm

    out: Tensor = rmsnorm(x.reshape(-1, x.shape[-1]), weight, eps)  # fp32 math, one rounding
    return out.view(x.shape)
