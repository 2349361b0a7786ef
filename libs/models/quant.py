"""Weight-only int8 / int4 linear layers for CPU inference, kept quantized in memory.

Decode at batch 1 is bound by reading the weights once per token, so storing them in 8 or 4 bits
instead of bf16 cuts the bytes read per token (SmolLM2: 295 MB bf16, 148 MB int8, 103 MB int4 with
its int8 head). The matmuls run on packed-weight kernels in the activations' dtype:
- bf16 activations (a CPU with native bf16 math): torch's `_weight_int8pack_mm` and
  `_weight_int4pack_mm_for_cpu`;
- fp32 activations (int8 only; a CPU without bf16 math, where bf16 products are emulated and
  slow): the CPU extension's `int8_linear` (libs/kernels/int8_linear.py), since torch's kernels
  with fp32 activations are over 10x slower than a dense matmul.

Those kernels lose to a dense matmul once a call carries many tokens (prefill), so from
`dense_min_tokens` tokens on a layer dequantizes its weight into a temporary dense matrix and uses
F.linear instead; the temporary is dropped after the call, memory stays quantized.
"""

from __future__ import annotations

import abc
import functools
from typing import ClassVar, Final

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from libs.kernels.decoder_blocks import BlockWeights
from libs.kernels.int8_linear import int8_linear
from libs.models.llama import LlamaDecoderLayer, LlamaForCausalLM

__all__ = ["INT4_GROUP_SIZE", "Int4Linear", "Int8Linear", "int8_block_weights", "quantize_model"]

# From this many tokens per call a layer dequantizes and runs a dense bf16 matmul instead of the packed
# kernel: where the two paths cross in a SmolLM2 forward on an AVX-512 BF16 CPU (1 and 2 threads). The
# packed kernels barely speed up with more tokens (one thread, 32 -> 128 tokens: int8 175 -> 190 tok/s,
# int4 205 -> 212), while dequantizing costs ~0.3 ms (int8) / ~1.5 ms (int4) per 1M weights per call.
INT8_DENSE_MIN_TOKENS: Final = 64
# With fp32 activations (the CPU extension's int8 kernel against a dense fp32 matmul on a CPU without
# bf16 math) the crossing is later: a SmolLM2 forward of 64 tokens took 199 ms packed and 292 ms dense,
# of 128 tokens 457 and 422 ms.
INT8_FP32_DENSE_MIN_TOKENS: Final = 128
INT4_DENSE_MIN_TOKENS: Final = 128
# 32 is the finest group the CPU kernel takes, and the one the Q4_1 GGUF was made with: re-quantizing
# its weights at 32 reproduces them up to the bf16 rounding of scale and zero.
INT4_GROUP_SIZE: Final = 32
INT4_GROUP_SIZES: Final = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
# The CPU int4 pack interleaves rows in blocks of 64 (see `_unpack_int4`).
_INT4_BLOCK_N: Final = 64


class _PackedLinear(nn.Module, abc.ABC):
    """Shared forward: [..., K] -> [..., N] through the packed kernel, or dense for many tokens.

    Subclasses provide `_matmul` (the kernel on [M, K] activations in `compute_dtype`) and
    `dequantize` (the dense [N, K] weight in `compute_dtype`). Other input dtypes are cast in and
    the output cast back.
    """

    in_features: int
    out_features: int
    dense_min_tokens: ClassVar[int]

    @property
    @abc.abstractmethod
    def compute_dtype(self) -> torch.dtype: ...

    @abc.abstractmethod
    def dequantize(self) -> Tensor: ...

    @abc.abstractmethod
    def _matmul(self, x2d: Tensor) -> Tensor: ...

    def _dense_from(self) -> int:
        """Tokens per call from which the dense path runs."""
        return self.dense_min_tokens

    def _dense(self, x2d: Tensor) -> Tensor:
        """The product through a dense weight made for this call (prefill-sized inputs)."""
        return F.linear(x2d, self.dequantize())

    def forward(self, x: Tensor) -> Tensor:
        # Casts and reshapes only where needed: at one token a step runs ~120 of these, and each
        # no-op call still costs microseconds.
        x2d = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # [num_tokens, K]
        if x2d.dtype != self.compute_dtype:
            x2d = x2d.to(self.compute_dtype)
        if not x2d.is_contiguous():
            x2d = x2d.contiguous()
        dense = x2d.shape[0] >= self._dense_from()
        out = self._dense(x2d) if dense else self._matmul(x2d)
        if x.dim() != 2:
            out = out.reshape(*x.shape[:-1], self.out_features)
        return out if out.dtype == x.dtype else out.to(x.dtype)


@functools.cache
def _bf16_math() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 / AMX)."""
    return bool(torch.cpu._is_avx512_bf16_supported())


class Int8Linear(_PackedLinear):
    """y = x @ W.T with W stored as int8 [N, K] and one symmetric scale per output row.

    W[n, k] = weight_int8[n, k] * scales[n]; the compute dtype is the scales' (the model's: bf16 or fp32).
    """

    dense_min_tokens = INT8_DENSE_MIN_TOKENS
    fp32_dense_min_tokens: ClassVar[int] = INT8_FP32_DENSE_MIN_TOKENS
    weight_int8: Tensor  # [out_features, in_features] int8
    scales: Tensor  # [out_features], compute dtype

    def __init__(self, weight_int8: Tensor, scales: Tensor) -> None:
        super().__init__()
        # Products that may round the activations: bf16 for prefill-sized ones on a CPU with bf16
        # math (``_dense``), int16 from 4 rows in the extension's kernel (libs/kernels/int8_linear.py).
        # quantize_model turns it off for the LM head, whose logits decide tokens and report logprobs.
        self.round_activations = True
        self.out_features, self.in_features = map(int, weight_int8.shape)
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales)

    @classmethod
    def from_weight(cls, weight: Tensor, dtype: torch.dtype = torch.bfloat16) -> Int8Linear:
        """Quantize a dense [N, K] weight; `dtype` is the activation (and scale) dtype."""
        w = weight.detach().float()
        # Round the scale to the compute dtype first, so q is chosen for the scale actually used.
        scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).to(dtype)
        q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scales)

    def dequantize(self) -> Tensor:
        """The dense [N, K] weight in the compute dtype."""
        return self.weight_int8.to(self.scales.dtype) * self.scales[:, None]

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales.dtype

    def _dense_from(self) -> int:
        return self.fp32_dense_min_tokens if self.scales.dtype == torch.float32 else self.dense_min_tokens

    def _dense(self, x2d: Tensor) -> Tensor:
        # fp32 activations on a CPU with native bf16 math: a prefill's product in bf16 takes half
        # the fp32 one's time (a 512-token SmolLM2 forward 624 -> ~1010 tok/s, bf16's speed), at
        # bf16's rounding of inputs and weights, as a bf16 model prefills. (A decode step of 128
        # tokens or more, drafts included, takes it too.)
        if self.round_activations and self.scales.dtype == torch.float32 and x2d.is_cpu and _bf16_math():
            weight = self.dequantize().to(torch.bfloat16)  # one rounding of the fp32 weight
            return F.linear(x2d.to(torch.bfloat16), weight).float()
        return F.linear(x2d, self.dequantize())

    def _matmul(self, x2d: Tensor) -> Tensor:
        if self.scales.dtype == torch.float32:  # fp32 activations: the CPU extension's kernel
            return int8_linear(x2d, self.weight_int8, self.scales, self.round_activations)
        out: Tensor = torch.ops.aten._weight_int8pack_mm(x2d, self.weight_int8, self.scales)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row"


class Int4Linear(_PackedLinear):
    """y = x @ W.T with W stored as 4-bit codes, asymmetric, one (scale, zero) per group of K.

    For row n and group g = k // group_size: W[n, k] = (code[n, k] - 8) * scale[g, n] + zero[g, n],
    the convention of torch's int4 kernel. `packed` is that kernel's CPU layout ([N, K / 2] uint8);
    `scales_and_zeros` is [K / group_size, N, 2] in the compute dtype.
    """

    dense_min_tokens = INT4_DENSE_MIN_TOKENS
    packed: Tensor
    scales_and_zeros: Tensor
    # Derived from scales_and_zeros for `dequantize`, [N, groups] fp32 each, contiguous; not in the
    # state dict (non-persistent), rebuilt whenever one is loaded.
    dense_scale: Tensor
    dense_offset: Tensor  # the value of code 0: zero - 8 * scale

    def __init__(self, packed: Tensor, scales_and_zeros: Tensor, group_size: int) -> None:
        super().__init__()
        num_groups, self.out_features, _ = scales_and_zeros.shape
        self.group_size = group_size
        self.in_features = num_groups * group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self._derive_dense_params()
        # torch leaves the registration unannotated.
        self.register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]
            lambda module, _incompatible_keys: module._derive_dense_params()
        )

    @classmethod
    def from_weight(
        cls, weight: Tensor, group_size: int = INT4_GROUP_SIZE, dtype: torch.dtype = torch.bfloat16
    ) -> Int4Linear:
        """Quantize a dense [N, K] weight (min/max per group, like GGUF Q4_1)."""
        n, k = weight.shape
        if group_size not in INT4_GROUP_SIZES or k % group_size:
            raise ValueError(f"group_size {group_size} must be one of {INT4_GROUP_SIZES} and divide K={k}")
        if n % _INT4_BLOCK_N:
            raise ValueError(f"int4 needs out_features divisible by {_INT4_BLOCK_N}, got {n}")
        w = weight.detach().float().reshape(n, k // group_size, group_size)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [N, groups]
        scale = ((hi - lo).clamp(min=1e-12) / 15).to(dtype)
        zero = (lo + 8 * scale.float()).to(dtype)  # the value of code 8
        # Codes chosen for the scale and zero as rounded to the compute dtype, which the kernel uses.
        codes = torch.round((w - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, 15)
        codes = codes.to(torch.int32).reshape(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        if not torch.equal(_unpack_int4(packed), codes.to(torch.uint8)):
            # The layout is torch-internal; `dequantize` relies on it, so fail loudly if it moved.
            raise RuntimeError("unexpected int4 pack layout in this torch build")
        scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        return cls(packed, scales_and_zeros, group_size)

    def dequantize(self) -> Tensor:
        """The dense [N, K] weight in the compute dtype."""
        n, k, g = self.out_features, self.in_features, self.group_size
        codes = _unpack_int4(self.packed).float().view(n, k // g, g)
        w = (codes * self.dense_scale[..., None]).add_(self.dense_offset[..., None])
        return w.view(n, k).to(self.scales_and_zeros.dtype)

    def _derive_dense_params(self) -> None:
        """dense_scale / dense_offset from scales_and_zeros: once, not per dense call."""
        # [N, groups] each, made contiguous: broadcasting strided ones is ~20x slower on CPU.
        scale = self.scales_and_zeros[..., 0].t().float().contiguous()
        offset = (self.scales_and_zeros[..., 1].t().float() - 8 * scale).contiguous()  # code 0's value
        self.register_buffer("dense_scale", scale, persistent=False)
        self.register_buffer("dense_offset", offset, persistent=False)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    def _matmul(self, x2d: Tensor) -> Tensor:
        out: Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2d, self.packed, self.group_size, self.scales_and_zeros
        )
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 g{self.group_size}"


def _unpack_int4(packed: Tensor) -> Tensor:
    """CPU int4 pack [N, K / 2] uint8 -> codes [N, K] uint8.

    Rows come in blocks of b (64 where torch's kernel uses AVX-512, 32 with AVX2 only); a block's
    bytes, read as [K, b / 2], hold row j of the block in the low nibble and row b / 2 + j in the
    high nibble of column j.
    """
    n, half_k = packed.shape
    block_n = _int4_pack_block_n()
    blocks = packed.view(n // block_n, 2 * half_k, block_n // 2)  # [N / b, K, b / 2]
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=1)  # [N / b, 2, K, b / 2]
    return codes.transpose(2, 3).reshape(n, 2 * half_k)


@functools.cache
def _int4_pack_block_n() -> int:
    """The row block of this build's CPU int4 pack, found by packing known codes once."""
    codes = torch.arange(_INT4_BLOCK_N * 32, dtype=torch.int32).reshape(_INT4_BLOCK_N, 32) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    for block_n in (64, 32, 16):
        blocks = packed.view(_INT4_BLOCK_N // block_n, 32, block_n // 2)
        unpacked = torch.stack([blocks & 0xF, blocks >> 4], dim=1).transpose(2, 3).reshape(_INT4_BLOCK_N, 32)
        if torch.equal(unpacked, codes.to(torch.uint8)):
            return block_n
    return _INT4_BLOCK_N  # unknown: from_weight's round-trip check then refuses loudly


def quantize_model(model: LlamaForCausalLM, fmt: str, group_size: int = INT4_GROUP_SIZE) -> None:
    """Replace every decoder projection and the LM head with int8 or int4 layers, in place.

    Activations keep the model's dtype: bf16 for both formats, or fp32 for int8 (int4's kernel
    wants bf16). The fp32 residual stream is untouched. `group_size` applies to the int4
    projections. The LM head is int8 in both formats: at int4 (g32)
    SmolLM2's logits drift 4x further from fp32 (max |dlogit| 4.9 vs 1.4, top-1 86% vs 96%), while
    the head is only a fifth of the weights. A tied head gets its own quantized copy of the embedding
    table; the table stays dense for lookups (one row per token, so it costs no bandwidth).
    """
    if fmt not in ("int8", "int4"):
        raise ValueError(f"fmt={fmt!r}: expected 'int8' or 'int4'")
    allowed = (torch.bfloat16, torch.float32) if fmt == "int8" else (torch.bfloat16,)
    if model.dtype not in allowed:
        raise ValueError(
            f"quantize_model({fmt}) needs a {' or '.join(map(str, allowed))} model, got {model.dtype}"
        )
    if isinstance(model.lm_head, _PackedLinear):
        raise ValueError("model is already quantized")
    dtype = model.dtype

    def convert(linear: nn.Module) -> _PackedLinear:
        assert isinstance(linear, nn.Linear) and linear.bias is None
        if fmt == "int4":
            return Int4Linear.from_weight(linear.weight, group_size, dtype)
        return Int8Linear.from_weight(linear.weight, dtype)

    for layer in model.layers:
        assert isinstance(layer, LlamaDecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj, attn.o_proj = convert(attn.qkv_proj), convert(attn.o_proj)
        mlp.gate_up_proj, mlp.down_proj = convert(mlp.gate_up_proj), convert(mlp.down_proj)
    head = model.lm_head.weight if isinstance(model.lm_head, nn.Linear) else model.embed_tokens.weight
    model.lm_head = Int8Linear.from_weight(head, dtype)
    model.lm_head.round_activations = False  # logits in the activations' precision at any row count


def int8_block_weights(model: LlamaForCausalLM) -> BlockWeights | None:
    """The model's decoder blocks as libs.kernels.decoder_blocks takes them, when every block
    projection is int8 with fp32 activations (and so every norm fp32); else None."""
    if model.dtype != torch.float32:
        return None
    layers = [layer for layer in model.layers if isinstance(layer, LlamaDecoderLayer)]
    projections = [
        (b.self_attn.qkv_proj, b.self_attn.o_proj, b.mlp.gate_up_proj, b.mlp.down_proj) for b in layers
    ]
    if not layers or any(not isinstance(p, Int8Linear) for group in projections for p in group):
        return None
    int8 = [[p for p in group if isinstance(p, Int8Linear)] for group in projections]  # typed for mypy
    cfg = model.config
    return BlockWeights(
        input_norm=[b.input_layernorm.weight.detach() for b in layers],
        qkv_weight=[g[0].weight_int8 for g in int8],
        qkv_scales=[g[0].scales for g in int8],
        o_weight=[g[1].weight_int8 for g in int8],
        o_scales=[g[1].scales for g in int8],
        post_norm=[b.post_attention_layernorm.weight.detach() for b in layers],
        gate_up_weight=[g[2].weight_int8 for g in int8],
        gate_up_scales=[g[2].scales for g in int8],
        down_weight=[g[3].weight_int8 for g in int8],
        down_scales=[g[3].scales for g in int8],
        final_norm=model.norm.weight.detach(),
        eps=cfg.rms_norm_eps,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
    )
