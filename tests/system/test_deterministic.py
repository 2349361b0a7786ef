"""``deepinfer serve --deterministic`` with the real SmolLM2 in bf16: 8 prompts give the same tokens
one at a time (the first cold) as all at once, in 24-token prefill chunks, with a KV pool so small
that sequences are preempted, greedy and seeded, and (greedy) again one at a time on prefix-cache
hits.
fp32 is refused at start, with the reason."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.system.serve_proc import MODEL, Serve, free_ports, scrape, serving
from tests.system.stack import spawn

READY_S = 180.0
QUESTIONS = [
    "Name three primary colors.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give two uses of a paperclip.",
    "Why is the sky blue? Answer briefly.",
    "List the first five prime numbers and say what makes them prime.",
    "Translate 'good morning' into Spanish and French.",
    "Say something kind to a friend who lost a game.",
]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 32, "ignore_eos": True}
SEEDED: dict[str, Any] = {**GREEDY, "temperature": 1.0, "top_p": 0.9, "seed": 1234}
# 0.006 GiB of bf16 KV is 17 blocks of 16 SmolLM2 tokens: eight requests of ~75 cannot all stay.
# --dtype auto (over serve_proc's float32): with --deterministic, auto is bf16.
FLAGS = ("--deterministic", "true", "--dtype", "auto", "--max-num-seqs", "8", "--kv-cache-gb", "0.006")
FLAGS += ("--host-cache-gb", "0", "--kv-store-path", "none", "--max-num-batched-tokens", "24")


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_ports(4)


@pytest.fixture(scope="module")
def serve(
    model_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory, metrics_port: int
) -> Iterator[Serve]:
    tmp = tmp_path_factory.mktemp("deterministic")
    flags = (*FLAGS, "--metrics-port", str(metrics_port))
    with serving(model_cache_dir, tmp, *flags, ready_s=READY_S) as running:
        yield running


async def _ask(client: httpx.AsyncClient, question: str, params: dict[str, Any]) -> tuple[str, int]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], **params}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    reply = resp.json()
    return reply["choices"][0]["message"]["content"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]


async def _one_at_a_time(url: str, params: dict[str, Any]) -> list[tuple[str, int]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return [await _ask(client, question, params) for question in QUESTIONS]


async def _all_at_once(url: str, params: dict[str, Any]) -> list[tuple[str, int]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return list(await asyncio.gather(*(_ask(client, question, params) for question in QUESTIONS)))


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_tokens_do_not_depend_on_the_batch(serve: Serve, metrics_port: int, params: dict[str, Any]) -> None:
    alone = asyncio.run(_one_at_a_time(serve.url, params))
    texts = [text for text, _ in alone]
    assert len(set(texts)) == len(QUESTIONS) and all(texts)
    before = scrape(metrics_port)
    preempted = scrape(metrics_port + 1).get(("deepinfer_preemptions_total", ()), 0.0)
    together = asyncio.run(_all_at_once(serve.url, params))
    assert [text for text, _ in together] == texts
    after = scrape(metrics_port)
    # Steps really held several sequences, and some were preempted for KV blocks.
    several = ("deepinfer_worker_step_sequences_bucket", (("le", "2.0"),))
    count = ("deepinfer_worker_step_sequences_count", ())
    assert (after[count] - before[count]) - (after[several] - before[several]) > 10
    assert scrape(metrics_port + 1)[("deepinfer_preemptions_total", ())] > preempted
    if params is GREEDY:  # once more, each prompt's full blocks cached by the runs before
        again = asyncio.run(_one_at_a_time(serve.url, params))
        assert [text for text, _ in again] == texts
        assert all(cached > 0 for _, cached in again)


def test_fp32_is_refused_with_the_reason(model_cache_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    proc = spawn(
        "worker",
        *("--nats-url", "nats://127.0.0.1:1", "--cache-dir", str(model_cache_dir)),
        *("--dtype", "float32", "--deterministic", "true", "--kv-store-path", "none"),
        log=log,
    )
    assert proc.wait(120) != 0
    assert "--deterministic: it needs bfloat16 activations" in log.read_text()
