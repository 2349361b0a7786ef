"""Tests of the compose stack, the Dockerfile and .dockerignore as they are (no Docker needed).

The real files must have no problem; nats-server itself must accept the nats service's config; the
``pd`` profile's prefill workers share the decode workers' store; the parsers read what they must.
"""

from __future__ import annotations

import argparse
import os
import subprocess

import pytest

from libs.bus.nats_server import find_nats_server
from libs.runtime.settings import build_config
from services.worker.config import Config as WorkerConfig
from tests.unit.compose.check_image import dockerfile_problems, dockerignore_problems
from tests.unit.compose.check_nats import nats_problems
from tests.unit.compose.check_services import compose_problems
from tests.unit.compose.check_supervision import parse_duration
from tests.unit.compose.compose_file import (
    COMPOSE_DIR,
    DOCKERFILE,
    DOCKERIGNORE,
    NATS_DEFAULT_PORT,
    REPO,
    environment,
    load_compose,
)
from tests.unit.compose.dockerfile import OwnedDirs, user_owned_dirs
from tests.unit.compose.nats_conf import parse_nats_conf, parse_size


def test_compose_file_is_consistent() -> None:
    assert compose_problems(load_compose(), COMPOSE_DIR) == []


def test_nats_listens_where_services_connect() -> None:
    problems, port = nats_problems(load_compose(), COMPOSE_DIR)
    assert problems == []
    assert port == NATS_DEFAULT_PORT


def test_nats_server_accepts_its_config() -> None:
    """nats-server itself (-t: check the config and exit) reads nats.conf with the nats service's
    environment (compose's defaults); without the login variables it refuses the file."""
    nats = load_compose()["services"]["nats"]
    conf = COMPOSE_DIR / "nats.conf"

    def check(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        argv = [find_nats_server(), "-t", "-c", str(conf)]
        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
        return subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=30)

    ok = check(environment(nats))
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


def test_the_pd_profile_adds_prefill_workers_on_the_decode_workers_store() -> None:
    no_flags = argparse.Namespace()
    services = load_compose()["services"]
    prefill, decode = services["worker-prefill"], services["worker"]
    assert prefill["profiles"] == ["pd"] and "profiles" not in decode  # the plain stack is unchanged
    env = environment(prefill)
    assert env["DEEPINFER_KV_STORE_PATH"] == environment(decode)["DEEPINFER_KV_STORE_PATH"]
    assert build_config(WorkerConfig, no_flags, env).role == "prefill"
    assert build_config(WorkerConfig, no_flags, environment(decode)).role == "both"


def test_user_owned_dirs() -> None:
    owned = user_owned_dirs(DOCKERFILE.read_text())
    assert owned == OwnedDirs("1000", {"/cache", "/kv-store", "/home/deepinfer"})
    text = (
        "FROM python:3.11-slim\nRUN useradd --uid 1001 app && chown -R 1001:1001 /a && chown root /b\n"
        "RUN mkdir /c && chown app /c/\nUSER 1001\n"
    )
    assert user_owned_dirs(text) == OwnedDirs("1001", {"/a", "/c"})
    assert user_owned_dirs(text.replace("USER 1001\n", "")) == OwnedDirs("", {"/b"})
