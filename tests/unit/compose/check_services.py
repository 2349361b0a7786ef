"""The compose checker: ``compose_problems`` checks every service of docker-compose.yml.

Third-party images (nats, prometheus, grafana) keep to themselves; each deepinfer service is built
from the image (its volumes on directories the image's user owns), runs its own subcommand with a
valid Config, reaches the nats service with its login, keeps its cache on the shared named volume,
and is supervised; the gateway is reachable, and the workers scale.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from deepinfer.cli import SERVICES
from libs.runtime.settings import ENV_PREFIX, build_config
from tests.unit.compose.check_nats import nats_credentials, nats_problems
from tests.unit.compose.check_supervision import restart_problems, supervision_problems
from tests.unit.compose.compose_file import (
    ANY_HOST,
    REQUIRED_SERVICES,
    depends_on,
    environment,
    is_nats,
    is_third_party,
    parse_args,
    published_container_ports,
    raw_environment,
    string_list,
    volume_mounts,
)
from tests.unit.compose.dockerfile import user_owned_dirs


@dataclasses.dataclass(frozen=True)
class StackFacts:
    """What each service is checked against: the nats services, their client port and login, the
    declared volumes, and the Dockerfile (``dockerfile_text``: a test's copy in place of the file)."""

    base_dir: Path
    nats_names: set[str]
    nats_port: int
    credentials: dict[str, str]  # "DEEPINFER_NATS_USER" -> "${NATS_USER:-...}"
    volumes: set[str]
    dockerfile_text: str | None


def compose_problems(
    compose: dict[str, Any], base_dir: Path, dockerfile_text: str | None = None
) -> list[str]:
    """``dockerfile_text``: the image's Dockerfile in place of the one the build names (a test's copy)."""
    services = compose.get("services")
    if not isinstance(services, dict):
        return ["no services"]
    problems = [f"missing service {name!r}" for name in REQUIRED_SERVICES if name not in services]
    nats, nats_port = nats_problems(compose, base_dir)
    problems += nats
    facts = StackFacts(
        base_dir=base_dir,
        nats_names={name for name, svc in services.items() if is_nats(svc)},
        nats_port=nats_port,
        credentials=nats_credentials(services, base_dir),
        volumes=set(compose.get("volumes") or {}),
        dockerfile_text=dockerfile_text,
    )
    cache_volumes: dict[str, str] = {}  # service -> the named volume its cache dir is on
    for name, service in services.items():
        problems += _service_problems(name, service, facts, cache_volumes)
    if len(set(cache_volumes.values())) > 1:
        problems.append(f"cache dirs on different volumes: {cache_volumes}")
    return problems


def _service_problems(
    name: str, service: dict[str, Any], facts: StackFacts, cache_volumes: dict[str, str]
) -> list[str]:
    """One service; a deepinfer one whose cache dir is on a named volume adds it to ``cache_volumes``."""
    if name in facts.nats_names or is_third_party(service):
        problems = [
            f"{name}: {key} set on a non-deepinfer service"
            for key in environment(service)
            if key.startswith(ENV_PREFIX)
        ]
        return problems + restart_problems(name, service)
    problems = _image_problems(name, service, facts)
    command = string_list(service.get("command"))
    if command is None:
        return [*problems, f"{name}: command must be a list (the argv after `deepinfer`)"]
    args, error = parse_args(command)
    if args is None:
        return [*problems, f"{name}: `deepinfer {' '.join(command)}` does not parse: {error}"]
    if args.command not in SERVICES or not (name == args.command or name.startswith(args.command + "-")):
        return [*problems, f"{name}: runs subcommand {args.command!r}, not the {name!r} service"]
    return problems + _deepinfer_problems(name, service, args, facts, cache_volumes)


def _image_problems(name: str, service: dict[str, Any], facts: StackFacts) -> list[str]:
    problems = []
    if "build" in service:
        problems += _volume_owner_problems(name, service, facts)
    elif "image" not in service:
        problems.append(f"{name}: neither build nor image")
    if service.get("entrypoint") not in (None, ["deepinfer"]):
        problems.append(f"{name}: entrypoint must be the image's (deepinfer)")
    return problems


def _volume_owner_problems(name: str, service: dict[str, Any], facts: StackFacts) -> list[str]:
    """A fresh named volume takes the owner of the image's directory it is mounted on: one the image
    does not give its user is root-owned, and the service cannot write it."""
    build = service["build"] if isinstance(service["build"], dict) else {"context": service["build"]}
    dockerfile = facts.base_dir / str(build.get("context", ".")) / str(build.get("dockerfile", "Dockerfile"))
    if facts.dockerfile_text is not None:
        owned = user_owned_dirs(facts.dockerfile_text)
    elif dockerfile.resolve().is_file():
        owned = user_owned_dirs(dockerfile.read_text())
    else:
        return [f"{name}: build Dockerfile {dockerfile} does not exist"]
    return [
        f"{name}: volume {src} on {dst}, which the image does not give its user (uid {owned.uid}): "
        "a fresh volume there is root-owned"
        for src, dst in volume_mounts(service)
        if src in facts.volumes and dst.rstrip("/") not in owned.dirs
    ]


def _deepinfer_problems(
    name: str, service: dict[str, Any], args: Any, facts: StackFacts, cache_volumes: dict[str, str]
) -> list[str]:
    """A deepinfer service running its own subcommand: its Config, login, supervision and wiring."""
    config_cls = SERVICES[args.command][1]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    env, raw_env = environment(service), raw_environment(service)
    problems = [
        f"{name}: {key} is {raw_env.get(key)!r}, not {value!r} as the nats service's login"
        for key, value in facts.credentials.items()
        if raw_env.get(key) != value
    ]
    problems += [
        f"{name}: {key} is not a field of the {args.command} Config"
        for key in env
        if key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX) :].lower() not in fields
    ]
    try:
        config: Any = build_config(config_cls, args, env)
    except (ValueError, TypeError) as exc:
        return [*problems, f"{name}: bad configuration: {exc}"]
    if "nats" not in depends_on(service):
        problems.append(f"{name}: does not depend on nats")
    problems += restart_problems(name, service) + supervision_problems(name, service, args.command, config)
    problems += _nats_url_problems(name, config, facts)
    if "cache_dir" in fields:
        cache_problems, volume = _cache_dir_problems(name, service, config, facts.volumes)
        problems += cache_problems
        if volume is not None:
            cache_volumes[name] = volume
    if args.command == "gateway":
        problems += _gateway_problems(name, service, config)
    if args.command == "worker":
        problems += _worker_problems(name, service, env, args)
    return problems


def _nats_url_problems(name: str, config: Any, facts: StackFacts) -> list[str]:
    url = urlsplit(config.nats_url)
    if url.scheme != "nats" or url.hostname not in facts.nats_names or (url.port or 4222) != facts.nats_port:
        return [f"{name}: nats_url {config.nats_url} is not the nats service on port {facts.nats_port}"]
    return []


def _cache_dir_problems(
    name: str, service: dict[str, Any], config: Any, volumes: set[str]
) -> tuple[list[str], str | None]:
    """The cache dir's problems, or the named volume it is on."""
    volume = next(
        (src for src, dst in volume_mounts(service) if dst.rstrip("/") == config.cache_dir.rstrip("/")),
        None,
    )
    if not config.cache_dir:
        return [f"{name}: no cache dir set (it would land in the container's home)"], None
    if volume is None or volume not in volumes:
        return [f"{name}: cache dir {config.cache_dir} is not on a named volume"], None
    return [], volume


def _gateway_problems(name: str, service: dict[str, Any], config: Any) -> list[str]:
    """Listening on every interface, published on its port, health-checked there."""
    problems = []
    if config.host not in ANY_HOST:
        problems.append(f"{name}: listens on {config.host}, unreachable from outside the container")
    published = published_container_ports(service)
    if not published:
        problems.append(f"{name}: publishes no port")
    problems += [
        f"{name}: publishes container port {p}, gateway listens on {config.port}"
        for p in published
        if p != str(config.port)
    ]
    check = json.dumps((service.get("healthcheck") or {}).get("test", ""))
    if f":{config.port}/health" not in check:
        problems.append(f"{name}: no healthcheck against /health on port {config.port}")
    return problems


def _worker_problems(name: str, service: dict[str, Any], env: dict[str, str], args: Any) -> list[str]:
    """Nothing that stops `--scale worker=N`: no fixed name, published port or worker id."""
    problems = []
    if "container_name" in service:
        problems.append(f"{name}: container_name stops `--scale worker=N`")
    if service.get("ports"):
        problems.append(f"{name}: published ports stop `--scale worker=N`")
    if f"{ENV_PREFIX}WORKER_ID" in env or args.worker_id is not None:
        problems.append(f"{name}: a fixed worker id makes scaled replicas collide")
    return problems
