"""The tiny random DeepSeek-V3 checkpoint (MLA, MoE, MTP weights; the DeepSeek V4 vocabulary with
V4.1's markers) served by ``deepinfer serve --model DIR --chat-format deepseek-v4.1``: every API
answers, and greedy tokens through the whole stack equal transformers' on the same checkpoint,
with the worker drafting every decode's next token with the MTP module (random, so its drafts are
rejected: tests/unit/worker/test_mtp.py has one that drafts well). The text is noise (random
weights); the path is real."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from libs.models.tiny_deepseek import deepseek_v4_tokenizer_dir, write_tiny_checkpoint
from libs.recipe.tokenizer import Tokenizer
from tests.deepseek_reference import hf_from_dir, hf_greedy
from tests.system.serve_proc import Serve, free_ports, scrape, serving

READY_S = 240.0
NAME = "tiny-deepseek"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("models") / NAME
    write_tiny_checkpoint(directory, seed=7, tokenizer_dir=deepseek_v4_tokenizer_dir())
    return directory


@pytest.fixture(scope="module")
def metrics_port() -> int:
    """serve's first metrics port (the worker's; the scheduler's is the next)."""
    return free_ports(4)


@pytest.fixture(scope="module")
def serve(
    model_cache_dir: Path, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory, metrics_port: int
) -> Iterator[Serve]:
    tmp = tmp_path_factory.mktemp("deepseek-serve")
    with serving(
        model_cache_dir,
        tmp,
        *("--model", str(checkpoint), "--chat-format", "deepseek-v4.1"),
        *("--speculative-method", "mtp", "--speculative-policy", "fixed"),
        *("--metrics-port", str(metrics_port)),
        ready_s=READY_S,
    ) as proc:
        yield proc


def test_greedy_completion_equals_transformers(serve: Serve, checkpoint: Path, metrics_port: int) -> None:
    prompt = [100, 2000, 30000, 77, 128000, 5]
    body = {"model": NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    resp = httpx.post(f"{serve.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    tokenizer = Tokenizer.from_hf_dir(checkpoint)
    tokens = hf_greedy(hf_from_dir(checkpoint), prompt, 6, tokenizer.eos_token_id)
    assert choice["text"] == tokenizer.decode(tokens)
    assert resp.json()["usage"]["completion_tokens"] == len(tokens)
    drafted = scrape(metrics_port + 1)
    mtp = [
        v
        for (name, labels), v in drafted.items()
        if name == "deepinfer_spec_draft_tokens_total" and ("source", "mtp") in labels
    ]
    assert mtp and mtp[0] > 0, drafted  # the worker's drafts came back and were verified


def test_every_api_answers_in_the_deepseek_format(serve: Serve) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    chat = {"model": NAME, "messages": messages, "max_tokens": 5, "temperature": 0}
    resp = httpx.post(f"{serve.url}/v1/chat/completions", json=chat, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] in ("length", "stop")
    events = []
    with httpx.stream(
        "POST", f"{serve.url}/v1/chat/completions", json={**chat, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] in ("length", "stop")
    anthropic = {"model": NAME, "max_tokens": 5, "messages": [{"role": "user", "content": "Hello"}]}
    resp = httpx.post(f"{serve.url}/v1/messages", json=anthropic, timeout=60)
    assert resp.status_code == 200 and resp.json()["stop_reason"] in ("max_tokens", "end_turn"), resp.text
    resp = httpx.post(
        f"{serve.url}/v1/responses", json={"model": NAME, "input": "Hi", "max_output_tokens": 5}, timeout=60
    )
    assert resp.status_code == 200, resp.text


WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "weather", "parameters": WEATHER_ARGS, "strict": True},
}


@pytest.mark.parametrize("seed", [1, 2])
def test_a_forced_dsml_call_follows_the_schema(serve: Serve, seed: int) -> None:
    """Random weights, sampled: only the grammar makes this a call, whole and valid."""
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "max_tokens": 160,
        "temperature": 1.0,
        "seed": seed,
    }
    resp = httpx.post(f"{serve.url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_ARGS)


def test_a_format_beside_auto_dsml_tools_is_the_answer_or_a_call(serve: Serve) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [WEATHER_TOOL],
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        "thinking": {"type": "disabled"},  # a random model may never close its reasoning
        "max_tokens": 160,
        "temperature": 1.0,
        "seed": 3,
    }
    resp = httpx.post(f"{serve.url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    if message.get("tool_calls"):
        jsonschema.validate(json.loads(message["tool_calls"][0]["function"]["arguments"]), WEATHER_ARGS)
    else:
        jsonschema.validate(json.loads(message["content"]), schema)
