"""Worker process: ``deepinfer worker --nats-url URL [--model M] [--dtype D]``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

import torch

from deepinfer.runtime import run_service, setup_logging
from deepinfer.settings import build_config, resolve_cache_dir
from libs.bus.nats_bus import NatsBus
from libs.models.gguf_loader import load_llama
from libs.models.llama import LlamaForCausalLM
from libs.models.quant import quantize_model
from libs.models.registry import resolve_model_path
from libs.recipe.tokenizer import Tokenizer
from services.worker.config import Config
from services.worker.grammar import DEFAULT_BACKEND, Grammars
from services.worker.model_runner import ModelRunner, ModelShape
from services.worker.service import WorkerService

log = logging.getLogger(__name__)


def resolve_dtype(name: str) -> torch.dtype:
    """The activation and KV dtype. auto: bf16 where the CPU has native bf16 math (AVX-512 BF16 / AMX),
    else fp32. int8 / int4 weights run with bf16 activations (their fp32 CPU kernels are over 10x slower)."""
    if name == "auto":
        return torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else torch.float32
    if name in ("int8", "int4"):
        return torch.bfloat16
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def load_model(path: Path, cache_dir: Path, fmt: str) -> LlamaForCausalLM:
    """The model in weight format ``fmt`` (a --dtype value); activations in ``resolve_dtype(fmt)``."""
    dtype = resolve_dtype(fmt)
    model = load_llama(path, cache_dir, dtype=dtype)
    if fmt in ("int8", "int4"):
        quantize_model(model, fmt)  # weight-only: projections and LM head stay packed
        log.info("weights quantized to %s (activations %s)", fmt, dtype)
    return model


def grammar_vocab(path: Path, cache_dir: Path, vocab_size: int) -> list[bytes]:
    """The bytes of each token id a grammar may produce; b"" for special tokens and for ids past
    the tokenizer (a padded embedding table), which no grammar may emit as text."""
    tokenizer = Tokenizer.from_gguf(path, cache_dir)
    special = tokenizer.special_token_ids
    return [b"" if i in special else tokenizer.token_bytes(i) for i in range(vocab_size)]


def build_runner(config: Config, cache_dir: str) -> tuple[ModelRunner, int, str]:
    """Load the model and size the KV pool; returns (runner, max_model_len, model name)."""
    path = resolve_model_path(config.model)
    dtype = resolve_dtype(config.dtype)
    model = load_model(path, Path(cache_dir), config.dtype)
    max_model_len = config.max_model_len or model.config.max_position_embeddings
    shape = ModelShape.of(model.config)
    num_blocks = int(config.kv_cache_gb * 2**30) // shape.layout.bytes_per_block(config.block_size, dtype)
    log.info("model %s dtype=%s, %d KV blocks of %d tokens", path.name, dtype, num_blocks, config.block_size)
    grammars = Grammars(grammar_vocab(path, Path(cache_dir), model.config.vocab_size))
    grammars.warm(DEFAULT_BACKEND)  # the other backend is built on its first request
    runner = ModelRunner(model, shape, num_blocks, config.block_size, dtype, grammars=grammars)
    return runner, max_model_len, path.name.split(".")[0]


async def serve(config: Config, cache_dir: str, stop: asyncio.Event) -> None:
    runner, max_model_len, model_name = await asyncio.to_thread(build_runner, config, cache_dir)
    bus = await NatsBus.connect(config.nats_url, name=config.worker_id)
    try:
        await WorkerService(config, bus, runner, max_model_len, model_name).run(stop)
    finally:
        await bus.close()


def main(args: argparse.Namespace) -> None:
    config = build_config(Config, args, os.environ)
    cache_dir = resolve_cache_dir(config.cache_dir, os.environ)
    setup_logging(config.log_level, "worker")
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    run_service(lambda stop: serve(config, cache_dir, stop))
