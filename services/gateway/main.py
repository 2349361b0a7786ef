"""Gateway process: ``deepinfer gateway --nats-url URL --host H --port P``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import math
import os
import signal
import sys
from collections.abc import Iterator

import anyio
import uvicorn

from libs.bus.membership import announce
from libs.bus.nats_bus import NatsBus
from libs.grammar import resolve_backend
from libs.kvstore.media_store import MediaStore
from libs.protocol.member_messages import MemberInfo, MemberKind
from libs.protocol.subjects import Subjects
from libs.runtime.logs import setup_logging
from libs.runtime.process import StopEvent, run_service
from libs.runtime.settings import build_config, media_root, resolve_cache_dir
from libs.runtime.tracing import otel_endpoint, setup_tracing
from services.gateway.app import build_app
from services.gateway.auth import KeyFile
from services.gateway.cache_scope import CacheScoping
from services.gateway.config import Config
from services.gateway.image_admission import ImageAdmission
from services.gateway.kv_router import KVRouter
from services.gateway.response_store import ResponseStore
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the process skeleton owns signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _serve_http(server: _Server) -> bool:
    """``server.serve()``; False when it could not start: uvicorn then raises SystemExit, which
    must not escape a task (the loop would stop half-way, the process stay up)."""
    try:
        await server.serve()
    except SystemExit:
        return False
    return True


def router_of(config: Config) -> KVRouter | None:
    """The KV router (``--routing kv``), or None: submits go to any scheduler (round_robin)."""
    if config.routing != "kv":
        return None
    return KVRouter(config.router_cache_weight, config.router_load_weight, config.router_temperature)


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach ``host`` (a name other than localhost counts as public)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_open(config: Config) -> None:
    """Loudly, when anyone who reaches the port may use it."""
    if not config.api_keys_file and not is_loopback(config.host):
        log.warning(
            "!!! listening on %s without API keys: anyone who can reach port %d can use this "
            "server. Pass --api-keys-file (see `deepinfer api-key`), or bind 127.0.0.1 behind a "
            "proxy that checks keys.",
            config.host,
            config.port,
        )


def reload_on_sighup(keys: KeyFile | None) -> None:
    """SIGHUP reloads the keys file (and never stops the gateway, keys or not)."""

    def reload() -> None:
        if keys is None:
            log.info("SIGHUP: no --api-keys-file, nothing to reload")
        else:
            keys.reload()

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)


def image_admission(
    config: Config, cache_dir: str, service: GatewayService, served: ServedModel
) -> ImageAdmission:
    store = MediaStore(media_root(config.media_path, cache_dir))
    if served.vision is not None:
        log.info("images: %d tokens each, media store %s", served.vision.num_image_tokens, store.root)

    def live_encoders() -> set[str]:
        return {m.member_id for m in service.members.live(MemberKind.ENCODER)}

    limits = config.image_limits
    return ImageAdmission(service.bus, service.subjects, store, served.vision, limits, live_encoders)


async def serve(config: Config, cache_dir: str, stop: StopEvent, keys: KeyFile | None = None) -> None:
    # A configured backend that does not import here is replaced by the other one, with a warning.
    grammar_backend = await asyncio.to_thread(resolve_backend, config.grammar_backend)
    served = await asyncio.to_thread(
        ServedModel.load,
        config.model,
        cache_dir,
        config.served_model_name,
        config.max_model_len,
        config.chat_format,
        grammar_backend,
        config.grammar_limits,
    )
    subjects = Subjects(config.subject_prefix)
    reload_on_sighup(keys)
    bus = await NatsBus.connect(config.nats_url, name=config.gateway_id, auth=config.nats_auth)
    service = GatewayService(
        bus,
        subjects,
        config.gateway_id,
        config.submit_timeout_s,
        resume_grace_s=config.resume_grace_s,
        out_max_age_s=config.stream_retention_s,
        migration_limit=config.migration_limit,
        resubmit_window_s=config.resubmit_window_s,
        router=router_of(config),
    )
    try:
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
                    keys,
                    config.prices,
                    image_admission(config, cache_dir, service, served),
                ),
                host=config.host,
                port=config.port,
                log_level=config.log_level,
                access_log=False,
                log_config=None,  # uvicorn's own lines go through our handler (--log-format)
                timeout_graceful_shutdown=math.ceil(config.shutdown_grace_s),  # SIGTERM: streams finish
            )
        )
        info = MemberInfo(MemberKind.GATEWAY, config.gateway_id, model=served.name)
        # starlette streams a response through anyio, which imports its asyncio backend on first use:
        # ~20 ms of the first streamed response's TTFT (half of it, measured) paid here instead.
        anyio.get_cancelled_exc_class()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(announce(bus, subjects.members_bucket, info, stop))
            # Start the grammar compiler processes now, off the loop, not in the first constrained request.
            if served.grammar is not None:
                tg.create_task(asyncio.to_thread(served.grammar.warm, grammar_backend))
            serving = tg.create_task(_serve_http(server))
            stopping = tg.create_task(stop.wait())
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            server.should_exit = True  # no new connections; the running ones finish, within the grace
            stop.set()  # the server may have ended on its own (port taken): leave cleanly
            if stop.hurried.is_set():  # Ctrl-C: no drain (running requests are cancelled)
                server.config.timeout_graceful_shutdown = 0
            else:  # a second signal cuts the drain short
                hurried = tg.create_task(stop.hurried.wait())
                await asyncio.wait({serving, hurried}, return_when=asyncio.FIRST_COMPLETED)
                server.force_exit = True
                hurried.cancel()
    finally:
        await service.close()
        await bus.close()
        if served.grammar is not None:
            served.grammar.close()  # kills the compiler processes
    if not serving.result():
        sys.exit(1)  # the port is taken: a supervisor restarts this process


def main(args: argparse.Namespace) -> None:
    config = build_config(Config, args, os.environ)
    cache_dir = resolve_cache_dir(config.cache_dir, os.environ)
    setup_logging(config.log_level, "gateway", config.log_format)
    setup_tracing("gateway", otel_endpoint(config.otel_endpoint))
    # SIGHUP (serve forwards it at once) must not kill a gateway still loading: ignored until
    # serve() installs the reload.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    keys = KeyFile(config.api_keys_file) if config.api_keys_file else None  # a bad file: exit 2
    warn_if_open(config)
    run_service(lambda stop: serve(config, cache_dir, stop, keys), config.watchdog_s)
