"""Gateway process: ``deepinfer gateway --nats-url URL --host H --port P``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator

import uvicorn

from deepinfer.runtime import run_service, setup_logging
from deepinfer.settings import build_config, resolve_cache_dir
from libs.bus.membership import announce
from libs.bus.nats_bus import NatsBus
from libs.protocol.messages import MemberInfo, MemberKind
from libs.protocol.subjects import Subjects
from services.gateway.app import build_app
from services.gateway.cache_scope import CacheScoping
from services.gateway.config import Config
from services.gateway.grammar_check import warm_grammar
from services.gateway.response_store import ResponseStore
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the process skeleton owns signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(config: Config, cache_dir: str, stop: asyncio.Event) -> None:
    served = await asyncio.to_thread(
        ServedModel.load,
        config.model,
        cache_dir,
        config.served_model_name,
        config.max_model_len,
        config.chat_format,
        config.grammar_backend,
    )
    subjects = Subjects(config.subject_prefix)
    bus = await NatsBus.connect(config.nats_url, name=config.gateway_id)
    try:
        service = GatewayService(
            bus,
            subjects,
            config.gateway_id,
            config.submit_timeout_s,
            resume_grace_s=config.resume_grace_s,
            out_max_age_s=config.stream_retention_s,
        )
        await service.start()
        store = ResponseStore(bus, subjects.responses_bucket, config.responses_ttl_s)
        await store.start()
        server = _Server(
            uvicorn.Config(
                build_app(
                    service,
                    served,
                    store,
                    config.retry_after_s,
                    config.keepalive_s,
                    CacheScoping(config.retention_policy, config.tenant_header),
                ),
                host=config.host,
                port=config.port,
                log_level=config.log_level,
                access_log=False,
                timeout_graceful_shutdown=5,
            )
        )
        info = MemberInfo(MemberKind.GATEWAY, config.gateway_id, model=served.name)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(announce(bus, subjects.members_bucket, info, stop))
            # Import the grammar library now, off the loop, not in the first constrained request.
            tg.create_task(asyncio.to_thread(warm_grammar, config.grammar_backend))
            serving = tg.create_task(server.serve())
            stopping = tg.create_task(stop.wait())
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            server.should_exit = True
            stop.set()  # the server may have ended on its own (port taken): leave cleanly
    finally:
        await bus.close()


def main(args: argparse.Namespace) -> None:
    config = build_config(Config, args, os.environ)
    cache_dir = resolve_cache_dir(config.cache_dir, os.environ)
    setup_logging(config.log_level, "gateway")
    run_service(lambda stop: serve(config, cache_dir, stop))
