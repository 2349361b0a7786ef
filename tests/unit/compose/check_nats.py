"""Checks the compose nats service and the nats.conf it mounts: config, login, payload, JetStream.

``nats_problems`` also returns the client port the deepinfer services must connect to, and
``nats_credentials`` the login variables each of them must set alike.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from libs.bus.nats_server import MAX_PAYLOAD
from libs.runtime.settings import ENV_PREFIX
from tests.unit.compose.compose_file import (
    NATS_DEFAULT_PORT,
    flag_value,
    is_nats,
    raw_environment,
    string_list,
    volume_mounts,
)
from tests.unit.compose.nats_conf import parse_nats_conf, parse_size

NATS_AUTH_FIELDS = {"user": f"{ENV_PREFIX}NATS_USER", "password": f"{ENV_PREFIX}NATS_PASSWORD"}
# a compose variable with a non-empty default: unset, it would log nats in with an empty password
_VARIABLE_WITH_DEFAULT = re.compile(r"\$\{[A-Za-z_]\w*:?-[^}]+\}")


def read_nats_conf(
    service: dict[str, Any], command: list[str], base_dir: Path
) -> tuple[dict[str, str], list[str]]:
    """The parsed config file the nats service's ``-c`` names, or the problems that stop reading it."""
    conf_target = flag_value(command, "-c", "--config")
    if conf_target is None:
        return {}, ["nats: no config file (-c): max_payload can only be set in one"]
    sources = [src for src, dst in volume_mounts(service) if dst == conf_target]
    if not sources:
        return {}, [f"nats: config {conf_target} is not mounted from this directory"]
    conf_file = (base_dir / sources[0]).resolve()
    if not conf_file.is_file():
        return {}, [f"nats: config file {sources[0]} does not exist"]
    return parse_nats_conf(conf_file.read_text()), []


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


def nats_credentials(services: dict[str, Any], base_dir: Path) -> dict[str, str]:
    """What each deepinfer service must set to log in (empty: the nats config cannot be read)."""
    nats_service = services.get("nats")
    if not isinstance(nats_service, dict):
        return {}
    nats_command = string_list(nats_service.get("command") or []) or []
    conf = read_nats_conf(nats_service, nats_command, base_dir)[0]
    return nats_auth_problems(conf, raw_environment(nats_service))[1] if conf else {}


def nats_problems(compose: dict[str, Any], base_dir: Path) -> tuple[list[str], int]:
    """Problems of the nats service, and the client port it listens on."""
    service = compose.get("services", {}).get("nats")
    if not isinstance(service, dict):
        return ["no 'nats' service"], NATS_DEFAULT_PORT
    problems = []
    if not is_nats(service):
        problems.append(f"nats: image {service.get('image')!r} is not the official nats image")
    command = string_list(service.get("command") or [])
    if command is None:
        return [*problems, "nats: command must be a list"], NATS_DEFAULT_PORT
    conf, conf_problems = read_nats_conf(service, command, base_dir)
    problems += conf_problems
    if conf:
        problems += nats_auth_problems(conf, raw_environment(service))[0]
    problems += _payload_problems(conf) + _jetstream_problems(service, command, conf)
    port_text = flag_value(command, "-p", "--port") or conf.get("port") or str(NATS_DEFAULT_PORT)
    return problems, int(port_text)


def _payload_problems(conf: dict[str, str]) -> list[str]:
    payload = conf.get("max_payload")
    if payload is None:
        return ["nats: config sets no max_payload"]
    if parse_size(payload) != parse_size(MAX_PAYLOAD):
        return [f"nats: max_payload {payload} != {MAX_PAYLOAD}"]
    return []


def _jetstream_problems(service: dict[str, Any], command: list[str], conf: dict[str, str]) -> list[str]:
    """JetStream on (by flag or config block), its store dir on one of the service's volumes."""
    problems = []
    js_flag = "-js" in command or "--jetstream" in command
    js_conf = "jetstream" in conf and conf["jetstream"].lower() not in ("false", "disabled", "off")
    js_conf = js_conf and conf.get("jetstream.enabled", "true").lower() != "false"
    if not (js_flag or js_conf):
        problems.append("nats: JetStream is not enabled (-js or a jetstream block)")
    store_dir = flag_value(command, "-sd", "--store_dir") or conf.get("jetstream.store_dir")
    if store_dir is None:
        problems.append("nats: no JetStream store dir")
    elif not any(
        store_dir == dst or store_dir.startswith(dst.rstrip("/") + "/") for _, dst in volume_mounts(service)
    ):
        problems.append(f"nats: store dir {store_dir} is not on a volume")
    return problems
