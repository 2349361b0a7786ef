"""``deepinfer serve``: an embedded nats-server plus worker, scheduler, kvcache and gateway processes.

``--num-workers N`` workers, each its own process and ``--worker-id``: the first keeps the worker
Config's id, the next ones add ``-1``, ``-2``, ... to it; each is supervised on its own.

A plain supervisor (no event loop). Every Config is built first: a bad value fails before anything
starts. Then it starts everything, waits for the gateway's /health and watches: a child that dies
(nats-server included) is restarted with backoff, up to ``max_restarts`` within
``restart_window_s`` (past that: exit 1). Every exit path stops the services first and
nats-server last:

- SIGTERM: the gateway first (it stops taking requests and lets in-flight streams finish for up to
  ``shutdown_grace_s``), then the other services, then nats-server. The workers drain, but their
  scheduler leaves with them, so a worker still holding sequences lets them go within seconds.
- SIGINT (Ctrl-C): every service at once, SIGKILL after ``INTERRUPT_TIMEOUT_S``, then nats-server.

Children also get SIGKILL from the kernel if this process dies without cleaning up (Linux).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from deepinfer.restart_policy import RestartPolicy
from deepinfer.supervisor import (
    REGISTRY,
    Child,
    NatsChild,
    ServiceChild,
    Supervised,
    Supervisor,
    terminate,
    wait_exited,
)
from libs.bus.nats_server import EmbeddedNatsServer
from libs.modelfiles.registry import is_vision_model, resolve_model_path
from libs.runtime.logs import setup_logging
from libs.runtime.metrics_server import start_metrics_server
from libs.runtime.settings import add_config_args, build_config
from services.encoder.config import Config as EncoderConfig
from services.gateway.api_keys import read_keys_file
from services.gateway.config import Config as GatewayConfig
from services.kvcache.config import Config as KVCacheConfig
from services.scheduler.config import Config as SchedulerConfig
from services.worker.config import Config as WorkerConfig

log = logging.getLogger("deepinfer.serve")

STOP_TIMEOUT_S = 10.0  # SIGTERM to SIGKILL, for each service
INTERRUPT_TIMEOUT_S = 3.0  # the same after Ctrl-C: the whole stack is gone within 5 s
SHARED_MEMORY = "/dev/shm"  # host shared memory (tmpfs) on Linux
SERVICE_CONFIGS: dict[str, type] = {
    "worker": WorkerConfig,
    "scheduler": SchedulerConfig,
    "kvcache": KVCacheConfig,
    "encoder": EncoderConfig,  # a vision-language model's only (``vision_model``)
    "gateway": GatewayConfig,  # last: it serves once the others are up, and stops first
}


def vision_model(spec: str) -> bool:
    """Whether the model takes images (then serve starts an encoder for it)."""
    return is_vision_model(resolve_model_path(spec))


@dataclass(frozen=True, slots=True)
class Config:
    num_workers: int = field(
        default=1,
        metadata={"help": "worker processes, each with its own id (<worker id>, <worker id>-1, ...)"},
    )
    prefill_workers: int = field(
        default=0,
        metadata={
            "help": "P/D: worker processes with --role prefill (long prompts are prefilled there and "
            "handed to a decode worker through the shared store); with --decode-workers, instead of "
            "--num-workers"
        },
    )
    decode_workers: int = field(default=0, metadata={"help": "P/D: worker processes with --role decode"})
    num_schedulers: int = field(
        default=1,
        metadata={
            "help": "scheduler replicas (<scheduler id>, <scheduler id>-1, ...): they share the "
            "workers, and the gateway's router picks replica and worker per request"
        },
    )
    max_restarts: int = field(
        default=5,
        metadata={"help": "restarts of one process within --restart-window-s before serve gives up"},
    )
    restart_window_s: float = field(default=60.0, metadata={"help": "the window --max-restarts counts in"})
    restart_backoff_s: float = field(
        default=0.5,
        metadata={"help": "delay before a first restart, doubled for each next one in the window"},
    )
    max_restart_backoff_s: float = field(
        default=10.0, metadata={"help": "the longest delay before a restart"}
    )
    ready_timeout_s: float = field(
        default=600.0,
        metadata={
            "help": "how long the stack may take to answer /health (the first start "
            "converts the model's weights)"
        },
    )
    # Shared with the gateway's Config (one flag): the gateway drains for this long, serve waits for it.
    shutdown_grace_s: float = field(
        default=10.0, metadata={"help": "on SIGTERM, how long in-flight streams may take to finish"}
    )
    log_level: str = field(default="info", metadata={"help": "logging level"})
    log_format: str = field(
        default="text",
        metadata={"help": "log lines as text or json (each with its request id where it has one)"},
    )
    # Shared with the services' Configs (one flag): serve's own metrics take the port after theirs.
    metrics_port: int = field(
        default=0, metadata={"help": "Prometheus /metrics port of each service (0: not served)"}
    )

    def __post_init__(self) -> None:
        self.restart_policy()  # a bad value fails now, naming its key
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.num_schedulers < 1:
            raise ValueError(f"num_schedulers must be >= 1, got {self.num_schedulers}")
        if self.prefill_workers < 0 or self.decode_workers < 0:
            raise ValueError("prefill_workers and decode_workers must be >= 0")
        if self.prefill_workers + self.decode_workers and self.num_workers != 1:
            raise ValueError("num_workers: give either it or --prefill-workers / --decode-workers")
        if self.prefill_workers and not self.decode_workers:
            raise ValueError("decode_workers must be >= 1 with prefill workers (they only prefill)")
        for key in ("ready_timeout_s", "shutdown_grace_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")

    def worker_roles(self, default: str) -> list[str]:
        """Each worker's role, the first worker's first: prefill workers, then decode workers."""
        pd = ["prefill"] * self.prefill_workers + ["decode"] * self.decode_workers
        return pd or [default] * self.num_workers

    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(
            self.max_restarts, self.restart_window_s, self.restart_backoff_s, self.max_restart_backoff_s
        )


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=None, help="use this NATS instead of an embedded one")
    # A field two services share (nats_url, cache_dir, kv_store_path, ...) is one flag for both.
    for cls in (Config, *SERVICE_CONFIGS.values()):
        add_config_args(parser, cls)


class ChildExited(RuntimeError):
    """A process that should be running has exited."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        super().__init__(f"{proc.args!r} exited with {proc.returncode}")
        self.proc = proc


def check_alive(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """Raises ChildExited for the first of ``procs`` that has exited."""
    for proc in procs:
        if proc.poll() is not None:
            raise ChildExited(proc)


def is_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200  # type: ignore[no-any-return]
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(
    url: str,
    procs: Iterable[subprocess.Popen[bytes]],
    timeout_s: float,
    interval_s: float = 0.1,
    stopped: Callable[[], bool] = lambda: False,
) -> bool:
    """Poll ``url`` until it answers 200 (True), or until ``stopped()`` (False).

    Raises ChildExited if one of ``procs`` (those that serve it) exits first, TimeoutError after
    ``timeout_s``.
    """
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    while not stopped():
        check_alive(procs)
        if is_healthy(url):
            return True
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")
        time.sleep(interval_s)
    return False


class _Signals:
    """SIGINT/SIGTERM received by serve, in order (a handler may only record)."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)

    def hurried(self) -> bool:
        """Ctrl-C, or a second signal: stop now, no drain."""
        return signal.SIGINT in self.received or len(self.received) > 1


def _supervise(
    config: Config, services: list[ServiceChild], nats: EmbeddedNatsServer | None, signals: _Signals
) -> int:
    """Restart what dies until a signal (0), a child past its restart limit or not ready in time (1)."""
    children: list[Child] = [*([NatsChild(nats)] if nats is not None else []), *services]
    supervisor = Supervisor([Supervised(child, config.restart_policy()) for child in children])
    gateway: GatewayConfig = services[-1].config  # type: ignore[assignment]
    health_url = f"http://{gateway.host}:{gateway.port}/health"
    ready_deadline = time.monotonic() + config.ready_timeout_s
    ready, next_health_check = False, 0.0
    while not signals.received:
        now = time.monotonic()
        reason = supervisor.check(now)
        if reason is not None:
            log.error("%s: stopping the stack", reason)
            return 1
        if not ready and now >= next_health_check:
            ready = is_healthy(health_url)
            if ready:
                log.info(
                    "deepinfer ready: http://%s:%d/v1 (nats %s)", gateway.host, gateway.port, gateway.nats_url
                )
            elif now > ready_deadline:
                log.error("not ready after %.0f s: stopping the stack", config.ready_timeout_s)
                return 1
            next_health_check = now + 0.5
        time.sleep(0.1)
    log.info("%s: stopping the stack", signal.Signals(signals.received[0]).name)
    return 0


def _send(services: list[ServiceChild], command: str, sig: int) -> None:
    for child in services:
        if child.command == command:
            child.send(sig)


def _stop_services(config: Config, services: list[ServiceChild], signals: _Signals) -> None:
    """Services only (nats-server is stopped after them). SIGTERM: the gateway drains first."""
    if signals.received and not signals.hurried():
        gateway = services[-1]
        gateway.send(signal.SIGTERM)
        wait_exited([gateway], config.shutdown_grace_s + STOP_TIMEOUT_S, signals.hurried)
    if signals.hurried():
        # SIGINT as well: a service already stopping on SIGTERM cuts its drain short.
        terminate(services, (signal.SIGINT, signal.SIGTERM), INTERRUPT_TIMEOUT_S)
    else:
        terminate(services, (signal.SIGTERM,), STOP_TIMEOUT_S)


def extra_workers(
    worker: WorkerConfig, num_workers: int, roles: list[str] | None = None
) -> dict[str, WorkerConfig]:
    """The workers after the first, by process name (``worker-1``, ...), each with its own id (and
    ``roles[i]``, when given, as worker i's role)."""
    return {
        f"worker-{i}": dataclasses.replace(
            worker, worker_id=f"{worker.worker_id}-{i}", role=roles[i] if roles else worker.role
        )
        for i in range(1, num_workers)
    }


def extra_schedulers(scheduler: SchedulerConfig, num_schedulers: int) -> dict[str, SchedulerConfig]:
    """The scheduler replicas after the first, by process name (``scheduler-1``, ...), each with
    its own id."""
    return {
        f"scheduler-{i}": dataclasses.replace(scheduler, scheduler_id=f"{scheduler.scheduler_id}-{i}")
        for i in range(1, num_schedulers)
    }


def shared_memory_handoff(worker: WorkerConfig, roles: list[str]) -> tempfile.TemporaryDirectory[str] | None:
    """With prefill workers and no ``--handoff-dir``, a fresh handoff area in host shared memory
    (``/dev/shm``, where there is one): every worker of this stack shares the machine, so the
    partial blocks of P/D handoffs need not touch the store's disk. Removed when serve stops."""
    if "prefill" not in roles or worker.handoff_dir or not os.path.isdir(SHARED_MEMORY):
        return None
    area = tempfile.TemporaryDirectory(prefix="deepinfer-handoff-", dir=SHARED_MEMORY)
    log.info("P/D handoff area in host shared memory: %s", area.name)
    return area


def _spread_metrics_ports(configs: dict[str, Any]) -> dict[str, Any]:
    """One ``--metrics-port`` reaches every service that has the field (and serve itself): on one
    host they cannot all bind it, so the first takes the port itself and each next one, in the
    order of ``configs``, the port after."""
    with_port = [name for name, c in configs.items() if getattr(c, "metrics_port", 0)]
    for offset, name in enumerate(with_port):
        port = configs[name].metrics_port + offset
        if port > 65535:
            raise ValueError(f"metrics_port: no room for {len(with_port)} ports from {port - offset}")
        configs[name] = dataclasses.replace(configs[name], metrics_port=port)
        log.info("%s metrics on port %d", name, port)
    return configs


def check_security(gateway: GatewayConfig, nats_url: str) -> None:
    """ValueError (exit 2) now, not a restart loop later: a keys file the gateway would refuse, or
    TLS asked of the embedded nats-server, which serves none."""
    if not nats_url and gateway.nats_tls_ca_file:
        raise ValueError("the embedded nats-server serves no TLS: give --nats-url of a server that does")
    if gateway.api_keys_file:
        read_keys_file(gateway.api_keys_file)


def main(args: argparse.Namespace) -> None:
    # Every Config first: a bad value raises here (exit 2) before anything has started.
    config = build_config(Config, args, os.environ)
    configs: dict[str, Any] = {
        name: build_config(cls, args, os.environ) for name, cls in SERVICE_CONFIGS.items()
    }
    nats_url = args.nats_url or os.environ.get("DEEPINFER_NATS_URL", "")
    check_security(configs["gateway"], nats_url)
    if not vision_model(configs["worker"].model):
        del configs["encoder"]
    setup_logging(config.log_level, "serve", config.log_format)
    roles = config.worker_roles(configs["worker"].role)
    if len(roles) > 1 and configs["worker"].dist_init_addr:
        raise ValueError(
            "dist_init_addr names one tensor-parallel group's address: give it to one worker only"
        )
    handoff = shared_memory_handoff(configs["worker"], roles)
    if handoff is not None:
        configs["worker"] = dataclasses.replace(configs["worker"], handoff_dir=handoff.name)
    configs["worker"] = dataclasses.replace(configs["worker"], role=roles[0])
    extra = extra_workers(configs["worker"], len(roles), roles)
    replicas = extra_schedulers(configs["scheduler"], config.num_schedulers)
    # Extra processes' ports come after serve's, so that those of a one-of-each stack stay put.
    spread = _spread_metrics_ports({**configs, "serve": config, **extra, **replicas})
    config = spread.pop("serve")
    # All workers first, the gateway still last (it serves once the others are up, and stops first).
    workers = {"worker": spread.pop("worker"), **{name: spread.pop(name) for name in extra}}
    schedulers = {name: spread.pop(name) for name in replicas}
    gateway = {"gateway": spread.pop("gateway")}
    configs = {**workers, **spread, **schedulers, **gateway}
    commands = {**dict.fromkeys(extra, "worker"), **dict.fromkeys(replicas, "scheduler")}
    start_metrics_server(config.metrics_port, REGISTRY, "127.0.0.1")  # restarts, by service
    signals = _Signals()
    signal.signal(signal.SIGINT, signals)
    signal.signal(signal.SIGTERM, signals)
    services: list[ServiceChild] = []
    # SIGHUP: the gateways reload their API keys (serve itself has nothing to reload).
    signal.signal(signal.SIGHUP, lambda signum, frame: _send(services, "gateway", signal.SIGHUP))
    # serve owns the JetStream store, so that a restarted nats-server finds its streams again.
    store = None if nats_url else tempfile.TemporaryDirectory(prefix="deepinfer-nats-")
    # The embedded nats-server requires the credentials the services are given (every service's
    # NATS fields are shared flags: the gateway's stand for all).
    nats = None if store is None else EmbeddedNatsServer(store.name, auth=configs["gateway"].nats_auth)
    exit_code = 1
    try:
        if nats is not None:
            nats.start()
            nats_url = nats.url
        for name, service_config in configs.items():
            command = commands.get(name, name)
            child_config = dataclasses.replace(service_config, nats_url=nats_url)
            services.append(ServiceChild(name, child_config, command))
            services[-1].start()
        exit_code = _supervise(config, services, nats, signals)
    finally:
        if services:
            _stop_services(config, services, signals)
        if nats is not None:
            nats.stop()
        if store is not None:
            store.cleanup()
        if handoff is not None:
            handoff.cleanup()
        log.info("stopped")
    sys.exit(exit_code)
