"""How the worker's model is loaded: its device, activation dtype and weight format from the
flags, the architecture from the file, and (tensor parallel) this rank's shard of it."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from libs.kernels import cpu_ext
from libs.modelfiles.registry import VISION_ARCHITECTURES, model_architecture
from libs.models.deepseek_loader import load_deepseek_v3
from libs.models.deepseek_v3 import DeepseekV3ForCausalLM
from libs.models.gguf_loader import load_llama
from libs.models.llama import LlamaForCausalLM
from libs.models.llava_loader import load_llava_language
from libs.models.quant import quantize_model
from libs.models.sharding import Shard, parallelize, shard_model
from services.worker.kv_store import dtype_name

log = logging.getLogger(__name__)
CPU = torch.device("cpu")


def resolve_device(name: str) -> torch.device:
    """The worker's device, refused at start when this torch cannot use it (naming what is missing)."""
    if name.startswith("npu"):
        try:
            import torch_npu  # type: ignore[import-not-found]  # noqa: F401  (registers the npu device)
        except ImportError:
            raise ValueError(f"--device {name}: needs torch_npu (Ascend), which is not installed") from None
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this torch sees no CUDA device (torch {torch.__version__})")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_dtype(name: str, device: torch.device = CPU) -> torch.dtype:
    """The activation and KV dtype. auto: bf16 on an accelerator, and on a CPU with native bf16 math
    (AVX-512 BF16 / AMX), else fp32. int8 weights run with the same activations as auto (fp32 ones
    through the CPU extension's kernel); int4 weights with bf16 (torch's int4 kernel wants them).
    Both are CPU kernels."""
    if name in ("int8", "int4") and device.type != "cpu":
        raise ValueError(f"--dtype {name}: weight-only int8/int4 are CPU kernels; use bfloat16 on {device}")
    if name == "auto":
        bf16_math = device.type != "cpu" or torch.cpu._is_avx512_bf16_supported()
        return torch.bfloat16 if bf16_math else torch.float32
    if name == "int8":
        # fp32 int8 needs the extension's kernel: without it, torch's bf16 one is the faster route
        return torch.float32 if cpu_ext.ops() is not None else torch.bfloat16
    if name == "int4":
        return torch.bfloat16
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def resolve_format(
    name: str, device: torch.device = CPU, dense_only: bool = False, deterministic: bool = False
) -> str:
    """The weight format ``--dtype name`` loads: auto is int8 (with fp32 activations) on a CPU
    where the CPU kernels are built. Decode at a few rows reads every weight once a step, and int8
    halves bf16's bytes: at one row it decodes 3.7x as fast as fp32 on an AVX2 CPU and 1.7x as
    fast as bf16 on an AVX-512 BF16 one, and agrees with fp32's top-1 wherever fp32's top-2 margin
    is >= 0.5, as bf16 does (bench/weight_formats.py, bench/vs_llama_server.py). Elsewhere, and for
    models the int8 layers do not cover (``dense_only``: DeepSeek checkpoints, MTP drafting), auto
    is the activation dtype; with ``deterministic``, bf16 (batch invariance holds there only:
    determinism.py)."""
    if name != "auto":
        return name
    if deterministic:
        return "bfloat16"
    if device.type == "cpu" and not dense_only and cpu_ext.ops() is not None:
        return "int8"
    return dtype_name(resolve_dtype("auto", device))


# HF config.json architectures served from a checkpoint directory (GGUF files: llama).
# (V3.2 is the same model plus a sparse-attention indexer, which is not implemented here.)
DEEPSEEK_ARCHITECTURES = ("DeepseekV3ForCausalLM",)


def load_model(
    path: Path,
    cache_dir: Path,
    fmt: str,
    device: torch.device = CPU,
    with_mtp: bool = False,
    shard: Shard | None = None,
) -> LlamaForCausalLM | DeepseekV3ForCausalLM:
    """The model in weight format ``fmt`` (a --dtype value) on ``device``; activations in
    ``resolve_dtype(fmt, device)``. Found by architecture; one this worker cannot run is refused,
    naming the file and field. ``with_mtp``: with its MTP module, to draft with (DeepSeek-V3
    family); otherwise that stays on disk (V3's is 11.5B parameters). ``shard``: this rank's
    part of a tensor-parallel model: each rank reads the whole file into host memory and keeps its
    part there; only that part moves to an accelerator."""
    staging = CPU if shard is not None and device.type != "cpu" else device
    model = _load_whole(path, cache_dir, fmt, resolve_dtype(fmt, device), staging, with_mtp, shard)
    if shard is not None:
        parallelize(model, shard.tp)
    if staging != device:
        model.to(device)
        model.reset_rope_cache(device)
    return model


def _load_whole(
    path: Path,
    cache_dir: Path,
    fmt: str,
    dtype: torch.dtype,
    device: torch.device,
    with_mtp: bool,
    shard: Shard | None,
) -> LlamaForCausalLM | DeepseekV3ForCausalLM:
    architecture = model_architecture(path)
    if path.is_dir():
        supported = DEEPSEEK_ARCHITECTURES + VISION_ARCHITECTURES
        if architecture not in supported:
            raise ValueError(
                f"{path / 'config.json'}: architectures {architecture!r} is not served from a checkpoint "
                f"directory (supported: {', '.join(supported)}; llama as GGUF)"
            )
        if fmt in ("int8", "int4"):
            raise ValueError(f"--dtype {fmt}: weight-only int8/int4 is implemented for llama GGUF only")
        if architecture in VISION_ARCHITECTURES:
            if with_mtp or shard is not None:
                raise ValueError(f"{path}: a vision model runs with no MTP and one rank (no tensor parallel)")
            return load_llava_language(path, dtype, device)
        deepseek = load_deepseek_v3(path, dtype, device, with_mtp=with_mtp)
        if shard is not None:
            shard_model(deepseek, shard)
        return deepseek
    if with_mtp:
        raise ValueError(f"{path}: --speculative-method mtp needs a DeepSeek-V3-family checkpoint")
    if architecture != "llama":
        raise ValueError(f"{path}: general.architecture {architecture!r} is not supported (llama)")
    return load_llama_model(path, cache_dir, fmt, device, shard)


def load_llama_model(
    path: Path, cache_dir: Path, fmt: str, device: torch.device = CPU, shard: Shard | None = None
) -> LlamaForCausalLM:
    """A llama GGUF in weight format ``fmt`` on ``device`` (``shard``: this rank's part, quantized
    after it is cut, before its collectives are installed)."""
    dtype = resolve_dtype(fmt, device)
    model = load_llama(path, cache_dir, dtype=dtype, device=device)
    if shard is not None:
        shard_model(model, shard)
    if fmt in ("int8", "int4"):
        quantize_model(model, fmt)  # weight-only: projections and LM head stay packed
        log.info("weights quantized to %s (activations %s)", fmt, dtype)
    return model
