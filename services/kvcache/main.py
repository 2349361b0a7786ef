"""KV-cache process: ``deepinfer kvcache --nats-url URL --kv-store-path DIR|none``."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from libs.bus.nats_bus import NatsBus
from libs.runtime.logs import setup_logging
from libs.runtime.metrics_server import start_metrics_server
from libs.runtime.process import run_service
from libs.runtime.settings import build_config, kv_store_root, resolve_cache_dir
from services.kvcache import metrics
from services.kvcache.config import Config
from services.kvcache.service import KVCacheService


async def serve(config: Config, store_root: Path | None, stop: asyncio.Event) -> None:
    bus = await NatsBus.connect(config.nats_url, name=config.kvcache_id, auth=config.nats_auth)
    try:
        service = KVCacheService(config, bus, store_root)
        start_metrics_server(config.metrics_port, metrics.registry(service))
        await service.run(stop)
    finally:
        await bus.close()


def main(args: argparse.Namespace) -> None:
    config = build_config(Config, args, os.environ)
    setup_logging(config.log_level, "kvcache", config.log_format)
    store_root = kv_store_root(config.kv_store_path, resolve_cache_dir(config.cache_dir, os.environ))
    run_service(lambda stop: serve(config, store_root, stop), config.watchdog_s)
