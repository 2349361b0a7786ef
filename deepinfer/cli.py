"""The ``deepinfer`` command: ``serve`` (the whole stack) or one service for compose and scaling.

Only the light config modules are imported to build the parser; a service's main module (torch,
uvicorn, ...) is imported once its command is chosen.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from deepinfer import api_key, bench, health, serve
from libs.runtime.settings import add_config_args
from services.encoder.config import Config as EncoderConfig
from services.gateway.config import Config as GatewayConfig
from services.kvcache.config import Config as KVCacheConfig
from services.scheduler.config import Config as SchedulerConfig
from services.worker.config import Config as WorkerConfig

SERVICES: dict[str, tuple[str, type]] = {
    "gateway": ("the OpenAI-compatible HTTP front", GatewayConfig),
    "scheduler": ("admission, batching and routing", SchedulerConfig),
    "worker": ("the model on one device", WorkerConfig),
    "kvcache": ("the index of stored KV blocks: retention, eviction, lookups", KVCacheConfig),
    "encoder": ("a vision model's image encoder: images in, embeddings out (media store)", EncoderConfig),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="LLM serving over NATS")
    commands = parser.add_subparsers(dest="command", required=True)
    help_text = "the whole stack on this machine, each service its own process"
    serve.add_args(commands.add_parser("serve", help=help_text, description=help_text))
    for name, (help_text, config_cls) in SERVICES.items():
        add_config_args(commands.add_parser(name, help=help_text, description=help_text), config_cls)
    help_text = "exit 0 when a member of a kind is live (a healthcheck for the services without HTTP)"
    add_config_args(commands.add_parser("health", help=help_text, description=help_text), health.Config)
    help_text = "mint an API key and add its hash to a keys file (the gateway's --api-keys-file)"
    api_key.add_args(commands.add_parser("api-key", help=help_text, description=help_text))
    help_text = "load any OpenAI-compatible URL: throughput, latency and economics reports"
    bench.add_args(commands.add_parser("bench", help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    commands = {"serve": serve.main, "health": health.main, "api-key": api_key.main, "bench": bench.main}
    run = commands.get(args.command) or importlib.import_module(f"services.{args.command}.main").main
    try:
        run(args)
    except ValueError as exc:  # a bad configuration value: say which, no traceback
        print(f"deepinfer {args.command}: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C before the service's loop took SIGINT over: no traceback
        sys.exit(130)
