"""Rotary position embedding for the interleaved (GGUF/ggml) layout: reference and dispatching op.

llama.cpp's converter permutes the rows of Q and K so that ggml's rope, which rotates adjacent
pairs (x[2i], x[2i+1]) by angle pos * base^(-2i/head_dim), gives the same result as HF's
rotate_half layout. Weights used as stored in the GGUF therefore need this interleaved rotation.

`apply_rotary_qk` (q and k together, what llama.py calls) and `apply_rotary_interleaved` (one
tensor) run flashinfer's kernel for half-precision CUDA tensors; `apply_rotary_qk` runs the CPU
extension's (csrc/cpu_pointwise.cpp: one op over q and k, reading the cache by position) for fp32
CPU tensors; otherwise the complex-multiply fast path runs: each pair viewed as one complex
number, one multiply by e^(i * angle) instead of the reference's six elementwise ops and a stack
(same fp32 arithmetic, same result to the bit in our tests; bench/kernels.py has the speed-up).
The complex rotation depends on positions only: built once per step (`prepare_rotation`), it
serves q and k of every layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from libs.kernels import cpu_ext, flashinfer_available


def rope_cos_sin_cache(head_dim: int, max_positions: int, base: float, dtype: torch.dtype) -> Tensor:
    """cos and sin of every (position, pair) angle: [max_positions, head_dim] = cat(cos, sin).

    Row p holds cos(p * f_i) for i < head_dim/2 followed by sin(p * f_i), f_i = base^(-2i/head_dim).
    Angles are computed in fp64 so large positions keep their precision before the cast to dtype.
    """
    if head_dim % 2 != 0:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    positions = torch.arange(max_positions, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)  # [max_positions, head_dim / 2]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)


def yarn_cos_sin_cache(
    rope_dim: int,
    max_positions: int,
    base: float,
    factor: float,
    original_max_positions: int,
    beta_fast: float,
    beta_slow: float,
    attention_factor: float,
    dtype: torch.dtype,
) -> Tensor:
    """rope_cos_sin_cache's layout for YaRN-scaled frequencies (DeepSeek-V3's long-context rope).

    Pair i keeps its trained frequency f_i = base^(-2i/rope_dim) where it turns fast (fewer than
    beta_slow..beta_fast rotations over original_max_positions matter for interpolation) and
    takes f_i / factor where it turns slowly, with a linear ramp between the two correction
    dimensions; cos and sin are then multiplied by attention_factor. The ramp bounds are floored
    and ceiled, as DeepSeek's reference and transformers (truncate=True) do.
    """
    if rope_dim % 2 != 0:
        raise ValueError(f"rotary dim must be even, got {rope_dim}")

    def correction_dim(num_rotations: float) -> float:
        turns = original_max_positions / (num_rotations * 2 * math.pi)
        return rope_dim * math.log(turns) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))
    inv_freq = extrapolation / factor * ramp + extrapolation * (1 - ramp)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return (torch.cat([angles.cos(), angles.sin()], dim=-1) * attention_factor).to(dtype)


def apply_rotary_interleaved_reference(x: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> Tensor:
    """Rotate each adjacent pair (x[..., 2i], x[..., 2i+1]) by its angle at each token's position.

    x: [num_tokens, num_heads, head_dim]; positions: [num_tokens] int64;
    cos_sin_cache: [max_positions, head_dim] from rope_cos_sin_cache. Returns a new tensor shaped
    and typed like x; the rotation itself runs in fp32.
    """
    half = x.shape[-1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions).float()  # [num_tokens, head_dim]
    cos = cos_sin[:, None, :half]  # [num_tokens, 1, head_dim / 2]
    sin = cos_sin[:, None, half:]
    pairs = x.float().reshape(*x.shape[:-1], half, 2)  # [num_tokens, num_heads, head_dim / 2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def apply_rotary_interleaved(x: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> Tensor:
    """apply_rotary_interleaved_reference's result (fp32 math, x's shape and dtype), fast.

    x: [num_tokens, num_heads, head_dim]; positions: [num_tokens] int64;
    cos_sin_cache: [max_positions, head_dim] from rope_cos_sin_cache. To rotate a query and a key
    at the same positions use apply_rotary_qk, which shares the work between them.
    """
    if _flashinfer_eligible(x.dtype, x.device, cos_sin_cache):
        # The kernel takes a query and a key: x goes in as both and the second output is dropped.
        rotated, _ = _rotary_flashinfer(x, x, positions, cos_sin_cache)
        return rotated
    return _rotate(x, rotary_rotation(positions, cos_sin_cache))


def apply_rotary_qk(
    q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor, rotation: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(apply_rotary_interleaved(q, ...), apply_rotary_interleaved(k, ...)), the two sharing the work.

    q: [num_tokens, num_q_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim], same dtype;
    positions: [num_tokens] int64; cos_sin_cache: [max_positions, head_dim] from rope_cos_sin_cache.
    On CUDA in half precision this is one flashinfer launch over both. Elsewhere the rotation of
    each position is built once for both; pass `rotation` (from rotary_rotation, or
    prepare_rotation for a whole step) to reuse one across layers. It is ignored on the
    flashinfer route, which reads the cache itself.
    """
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    if _flashinfer_eligible(q.dtype, q.device, cos_sin_cache):
        return _rotary_flashinfer(q, k, positions, cos_sin_cache)
    ops = _cpu_ops(q.dtype, positions, cos_sin_cache) if q.is_cpu and q.dim() == k.dim() == 3 else None
    if ops is not None:
        q_out, k_out = ops.rotary_qk(q, k, positions, cos_sin_cache)
        return q_out, k_out
    if rotation is None:
        rotation = rotary_rotation(positions, cos_sin_cache)
    return _rotate(q, rotation), _rotate(k, rotation)


def rotary_rotation(positions: Tensor, cos_sin_cache: Tensor) -> Tensor:
    """e^(i * angle) of every (token, pair): [num_tokens, 1, head_dim / 2] complex64.

    The one per-step input of the torch route; it depends on positions only, so one serves q and k
    of every layer. positions: [num_tokens] int64; cos_sin_cache: [max_positions, head_dim].
    """
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions).float()  # [num_tokens, head_dim]
    return torch.complex(cos_sin[:, None, :half], cos_sin[:, None, half:])


def prepare_rotation(positions: Tensor, cos_sin_cache: Tensor, dtype: torch.dtype) -> Tensor | None:
    """The rotation apply_rotary_qk will want for q/k in `dtype` on positions' device this step:
    rotary_rotation's on the torch route, None where flashinfer or the CPU kernel runs (they need
    none)."""
    if _flashinfer_eligible(dtype, positions.device, cos_sin_cache):
        return None
    if _cpu_ops(dtype, positions, cos_sin_cache) is not None:
        return None  # the CPU kernel reads the cache itself
    return rotary_rotation(positions, cos_sin_cache)


def _cpu_ops(dtype: torch.dtype, positions: Tensor, cos_sin_cache: Tensor) -> Any | None:
    """The CPU extension where its kernel rotates: fp32 q/k and cache, int64 positions, all on the
    CPU (else None)."""
    if dtype != torch.float32 or positions.dtype != torch.int64 or not positions.is_cpu:
        return None
    return cpu_ext.fp32_ops(cos_sin_cache)


def _flashinfer_eligible(dtype: torch.dtype, device: torch.device, cos_sin_cache: Tensor) -> bool:
    """flashinfer's kernel: installed, CUDA, half-precision q/k, the fp32 cache it requires."""
    return (
        device.type == "cuda"
        and flashinfer_available()
        and dtype in (torch.float16, torch.bfloat16)
        and cos_sin_cache.dtype == torch.float32
    )


def _rotate(x: Tensor, rotation: Tensor) -> Tensor:
    """x [num_tokens, num_heads, head_dim] times rotation [num_tokens, 1, head_dim / 2] pairwise, in
    fp32; returns a new contiguous tensor in x.dtype."""
    half = x.shape[-1] // 2
    pairs = x.float().reshape(*x.shape[:-1], half, 2)  # [num_tokens, num_heads, head_dim / 2, 2]
    if not _complex_viewable(pairs):
        pairs = pairs.clone(memory_format=torch.contiguous_format)  # fresh storage: offset 0
    rotated = torch.view_as_complex(pairs) * rotation
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)


def _complex_viewable(pairs: Tensor) -> bool:
    """Whether view_as_complex accepts `pairs` [..., 2]: the pair dim dense, every other stride
    and the storage offset even. A q/k view into the fused qkv output is, so no copy is made."""
    even = pairs.storage_offset() % 2 == 0 and all(s % 2 == 0 for s in pairs.stride()[:-1])
    return even and pairs.stride(-1) == 1


def _rotary_flashinfer(
    q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor
) -> tuple[Tensor, Tensor]:
    from flashinfer.rope import apply_rope_with_cos_sin_cache

    # Same cache layout (cos half then sin half, fp32); is_neox=False is the interleaved rotation.
    # The kernel takes [num_tokens, heads * head_dim] and returns new tensors of those shapes.
    head_dim = q.shape[-1]
    q_flat = q.reshape(q.shape[0], -1)  # a view for q/k views into the fused qkv output
    k_flat = k.reshape(k.shape[0], -1)
    q_out, k_out = apply_rope_with_cos_sin_cache(
        positions, q_flat, k_flat, head_dim, cos_sin_cache, is_neox=False
    )
    return q_out.view(q.shape), k_out.view(k.shape)
