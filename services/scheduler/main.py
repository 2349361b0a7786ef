"""Scheduler process: ``deepinfer scheduler --nats-url URL``."""

from __future__ import annotations

import argparse
import asyncio
import os

from libs.bus.nats_bus import NatsBus
from libs.runtime.logs import setup_logging
from libs.runtime.metrics_server import start_metrics_server
from libs.runtime.process import run_service
from libs.runtime.settings import build_config
from libs.runtime.tracing import otel_endpoint, setup_tracing
from services.scheduler import metrics
from services.scheduler.config import Config
from services.scheduler.service import SchedulerService


async def serve(config: Config, stop: asyncio.Event) -> None:
    bus = await NatsBus.connect(config.nats_url, name=config.scheduler_id, auth=config.nats_auth)
    try:
        service = SchedulerService(config, bus)
        start_metrics_server(config.metrics_port, metrics.registry(service.workers))
        await service.run(stop)
    finally:
        await bus.close()


def main(args: argparse.Namespace) -> None:
    config = build_config(Config, args, os.environ)
    setup_logging(config.log_level, "scheduler", config.log_format)
    setup_tracing("scheduler", otel_endpoint(config.otel_endpoint))
    run_service(lambda stop: serve(config, stop), config.watchdog_s)
