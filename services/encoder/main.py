"""Encoder process: ``deepinfer encoder --model DIR --nats-url URL [--media-path DIR]``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import torch

from libs.bus.nats_bus import NatsBus
from libs.kvstore.media_store import MediaStore
from libs.modelfiles.llava_config import read_llava_config
from libs.modelfiles.registry import (
    VISION_ARCHITECTURES,
    is_vision_model,
    model_fingerprint,
    resolve_model_path,
)
from libs.models.llava_loader import load_llava_vision
from libs.runtime.logs import setup_logging
from libs.runtime.metrics_server import start_metrics_server
from libs.runtime.process import run_service
from libs.runtime.settings import build_config, media_root, resolve_cache_dir
from services.encoder import metrics
from services.encoder.config import Config
from services.encoder.image_encoder import ImageEncoder
from services.encoder.service import EncoderService

log = logging.getLogger(__name__)


def device_and_dtype(config: Config) -> tuple[torch.device, torch.dtype]:
    """The tower's device and dtype: auto is bf16 on an accelerator, fp32 on a CPU."""
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {config.device}: this torch sees no CUDA device")
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    if config.dtype == "auto":
        return device, torch.float32 if device.type == "cpu" else torch.bfloat16
    if config.dtype not in dtypes:  # serve's shared --dtype may name a weight format (int8)
        log.warning("--dtype %s: the vision tower runs in float32", config.dtype)
    return device, dtypes.get(config.dtype, torch.float32)


def build_service(config: Config, bus: NatsBus, cache_dir: str) -> EncoderService:
    path = resolve_model_path(config.model)
    if not is_vision_model(path):
        raise ValueError(f"model {config.model!r}: not a vision-language checkpoint {VISION_ARCHITECTURES}")
    device, dtype = device_and_dtype(config)
    llava = read_llava_config(path)
    tower = load_llava_vision(path, dtype, device)
    encoder = ImageEncoder(tower, llava.image_processing, device, dtype, config.max_batch_images)
    store = MediaStore(media_root(config.media_path, cache_dir))
    fingerprint = model_fingerprint(path)
    log.info("encoder for %s (%s, %s): %d tokens an image", path.name, device, dtype, llava.num_image_tokens)
    return EncoderService(config, bus, store, encoder, fingerprint)


async def serve(config: Config, cache_dir: str, stop: asyncio.Event) -> None:
    bus = await NatsBus.connect(config.nats_url, name=config.encoder_id, auth=config.nats_auth)
    try:
        service = build_service(config, bus, cache_dir)
        start_metrics_server(config.metrics_port, metrics.registry(service))
        await service.run(stop)
    finally:
        await bus.close()


def main(args: argparse.Namespace) -> None:
    config = build_config(Config, args, os.environ)
    setup_logging(config.log_level, "encoder", config.log_format)
    cache_dir = resolve_cache_dir(config.cache_dir, os.environ)
    run_service(lambda stop: serve(config, cache_dir, stop), config.watchdog_s)
