"""API keys through real processes: a gateway started with --api-keys-file on the shared stack,
keys minted by ``deepinfer api-key``, the official SDKs as clients, SIGHUP to reload, and a
malformed file refused at start (exit 2)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from libs.bus.nats_server import free_port
from tests.system.stack import READY_TIMEOUT_S, Stack, wait_healthy

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Say hi."}]


def mint(path: Path, tenant: str, *flags: str) -> str:
    """A new key from the CLI (stdout: the key, once)."""
    done = subprocess.run(
        [sys.executable, "-m", "deepinfer", "api-key", "--file", str(path), "--tenant", tenant, *flags],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


class KeyedGateway:
    def __init__(self, stack: Stack, path: Path) -> None:
        self.path = path
        self.port = free_port()
        self.proc = stack.spawn_gateway(self.port, "--api-keys-file", str(path))
        self.root = f"http://127.0.0.1:{self.port}"
        wait_healthy(f"{self.root}/health", [self.proc], stack.log, READY_TIMEOUT_S)

    def oai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.root}/v1", api_key=key, max_retries=0, timeout=120)

    def chat(self, key: str) -> str:
        reply = self.oai(key).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
        return reply.choices[0].message.content or ""

    def metric(self, line_start: str) -> float:
        for line in httpx.get(f"{self.root}/metrics").text.splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


Keyed = tuple[KeyedGateway, dict[str, str]]


@pytest.fixture(scope="module")
def keyed(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keyed]:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    keys = {"acme": mint(path, "acme"), "slow": mint(path, "slow", "--requests-per-minute", "2")}
    gateway = KeyedGateway(stack, path)
    yield gateway, keys
    gateway.proc.terminate()
    gateway.proc.wait(30)


def test_the_sdks_need_a_key(keyed: Keyed) -> None:
    gateway, keys = keyed
    assert gateway.chat(keys["acme"])
    with pytest.raises(openai.AuthenticationError):
        gateway.chat("sk-di-not-a-key")
    claude = anthropic.Anthropic(base_url=gateway.root, api_key=keys["acme"], max_retries=0, timeout=120)
    assert claude.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES).content  # type: ignore[arg-type]
    stranger = anthropic.Anthropic(base_url=gateway.root, api_key="sk-di-nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        stranger.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES)  # type: ignore[arg-type]
    assert gateway.metric('deepinfer_tenant_tokens_total{kind="output",tenant="acme"}') > 0


def test_a_limited_key_gets_429_with_retry_after(keyed: Keyed) -> None:
    gateway, keys = keyed
    for _ in range(2):
        gateway.chat(keys["slow"])
    with pytest.raises(openai.RateLimitError) as exc:
        gateway.chat(keys["slow"])
    assert 1 <= int(exc.value.response.headers["retry-after"]) <= 30
    assert exc.value.response.headers["x-ratelimit-limit-requests"] == "2"
    assert gateway.chat(keys["acme"])  # another key is not slowed


def test_sighup_reloads_the_keys(keyed: Keyed) -> None:
    gateway, keys = keyed
    late = mint(gateway.path, "late")
    with pytest.raises(openai.AuthenticationError):
        gateway.chat(late)  # not read yet
    gateway.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while True:
        try:
            assert gateway.chat(late)
            break
        except openai.AuthenticationError:
            assert time.monotonic() < deadline, "SIGHUP did not reload the keys file"
            time.sleep(0.2)
    # a malformed file on the next SIGHUP: the keys in force stay, the gateway lives on
    gateway.path.write_text("{not json")
    gateway.proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert gateway.proc.poll() is None
    assert gateway.chat(late) and gateway.chat(keys["acme"])


def test_a_malformed_keys_file_stops_the_gateway_at_start(stack: Stack, tmp_path: Path) -> None:
    bad = tmp_path / "keys.json"
    bad.write_text('{"keys": [{"sha256": "sk-di-plaintext", "tenant": "acme"}]}')
    proc = stack.spawn_gateway(free_port(), "--api-keys-file", str(bad))
    assert proc.wait(60) == 2
