"""The long-term KV cache through real processes: a long conversation repeated after every service
was stopped and started again on the same store directory hits G3 and gets the same output; the
same prompt under two API keys (two tenants) shares nothing; /metrics reports the hits per tier."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.system.kv_metrics import scheduler_kv_stat
from tests.system.stack import Stack

MODEL = "SmolLM2-135M-Instruct"
STORY = " ".join(
    f"Chapter {i}: the lighthouse keeper counted {i * 7} ships before the storm." for i in range(40)
)


def chat(base_url: str, messages: list[dict[str, str]], api_key: str = "") -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0}
    resp = httpx.post(f"{base_url}/chat/completions", json=body, headers=headers, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def cached(resp: dict[str, Any]) -> int:
    return int(resp["usage"]["prompt_tokens_details"]["cached_tokens"])


def hit_tokens(root_url: str, tier: str) -> float:
    """The schedulers' published hit_tokens counter for ``tier`` (0 before any is published)."""
    return scheduler_kv_stat(root_url, "hit_tokens", tier)


def wait_for(predicate: Any, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def store_files(store: Path) -> int:
    return sum(1 for _ in store.rglob("*.kvb"))


def test_a_conversation_repeated_after_a_full_restart_hits_g3(model_cache_dir: Path, tmp_path: Path) -> None:
    store, log = tmp_path / "kv-store", tmp_path / "stack.log"
    conversation = [
        {"role": "system", "content": "You answer questions about the story below.\n" + STORY},
        {"role": "user", "content": "How many ships did the keeper count in chapter 3?"},
    ]
    first = Stack.start(model_cache_dir, log, kv_store=store)
    try:
        before = chat(first.base_url, conversation)
        assert before["usage"]["prompt_tokens"] > 400
        # Block files are written off the step path; every full block of the prompt gets one.
        num_blocks = before["usage"]["prompt_tokens"] // 16
        assert wait_for(lambda: store_files(store) >= num_blocks), f"{store_files(store)} files"
    finally:
        first.stop()
    again = Stack.start(model_cache_dir, log, kv_store=store)
    try:
        after = chat(again.base_url, conversation)
        # Fresh processes hold nothing in device or host memory: every cached token came from G3.
        assert cached(after) >= (after["usage"]["prompt_tokens"] // 16 - 1) * 16
        assert after["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]
        assert wait_for(lambda: hit_tokens(again.root_url, "G3") >= cached(after))
    finally:
        again.stop()


def test_two_tenants_share_nothing(stack: Stack) -> None:
    messages = [{"role": "user", "content": "Tenant check. " + STORY[:1500]}]
    first = chat(stack.base_url, messages, api_key="key-of-tenant-a")
    assert cached(first) == 0  # nobody sent this prompt before
    same_tenant = chat(stack.base_url, messages, api_key="key-of-tenant-a")
    other_tenant = chat(stack.base_url, messages, api_key="key-of-tenant-b")
    assert cached(same_tenant) > 0
    assert cached(other_tenant) == 0
    contents = {r["choices"][0]["message"]["content"] for r in (first, same_tenant, other_tenant)}
    assert len(contents) == 1  # greedy fp32: cached or not, the same answer


@pytest.mark.parametrize("value", ["chat", "agent"])
def test_a_retention_class_is_accepted(stack: Stack, value: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    resp = httpx.post(
        f"{stack.base_url}/chat/completions",
        json={**body, "prompt_cache_retention": value},
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    bad = httpx.post(
        f"{stack.base_url}/chat/completions", json={**body, "prompt_cache_retention": "forever"}, timeout=60
    )
    assert bad.status_code == 400 and "prompt_cache_retention" in bad.text
