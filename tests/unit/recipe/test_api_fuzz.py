"""Request adapters under random bad bodies: every one parses or is an ``ApiError`` (a 400 with a
message), never another exception (which the gateway would answer with a 500).

A seeded fuzzer (plain ``random``, reproducible): each case starts from one of a few valid bodies,
applies a few random mutations anywhere in it (a value replaced by junk of another type, a key
deleted or added, a value wrapped in a list, a subtree grafted from another valid body), and
parses the result.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any

import pytest

from libs.recipe.api import (
    parse_chat_request,
    parse_completion_request,
    parse_count_tokens_request,
    parse_messages_request,
    parse_responses_request,
)
from libs.recipe.fields import ApiError
from tests.unit.recipe.api_helpers import MODEL

CASES_PER_PARSER = 3000
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "mode": {"anyOf": [{"$ref": "#/$defs/m"}, {"type": "null"}]},
    },
    "$defs": {"m": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    "required": ["city"],
}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
CHAT = [
    {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "developer", "content": [{"type": "text", "text": "Really."}]},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": ""}]},
            {"role": "assistant", "content": None, "reasoning_content": "Look.", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "18C"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
            {"role": "latest_reminder", "content": "Be kind."},
            {"role": "user", "content": "And tomorrow?"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "f", "description": "d", "parameters": SCHEMA}},
            {"type": "function", "function": {"name": "g", "parameters": SCHEMA, "strict": True}},
        ],
        "tool_choice": {"type": "function", "function": {"name": "g"}},
        "response_format": {
            "type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA, "strict": True}
        },
        "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.1, "repetition_penalty": 1.1,
        "presence_penalty": 0.1, "frequency_penalty": 0.1, "min_tokens": 1, "max_completion_tokens": 64,
        "stop": ["x", "y"], "stop_token_ids": [1, 2], "ignore_eos": False, "seed": 7, "n": 2,
        "logprobs": True, "top_logprobs": 3, "stream": True, "stream_options": {"include_usage": True},
        "metadata": {"k": "v"}, "chat_template_kwargs": {"a": 1}, "parallel_tool_calls": False,
        "user": "u", "store": False, "service_tier": "auto", "modalities": ["text"],
    },
    {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": "Answer in json"},
            {"role": "assistant", "content": "{", "prefix": True},
        ],
        "thinking": {"type": "enabled"},
        "reasoning_effort": "medium",
        "response_format": {"type": "json_object"},
        "tool_choice": "auto",
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "max_tokens": 10,
        "stop": "z",
    },
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "response_format": {"type": "regex", "regex": "[a-z]+"},
        "tool_choice": "none",
        "reasoning_effort": "none",
    },
]  # fmt: skip
COMPLETIONS = [
    {
        "model": MODEL, "prompt": "Once", "max_tokens": 5, "logprobs": 2, "n": 2, "best_of": 2,
        "echo": True, "stream": True, "stream_options": {"include_usage": False}, "stop": ["\n"],
        "temperature": 0.3, "top_k": -1, "seed": 1, "user": "u", "ignore_eos": True, "stop_token_ids": [3],
    },
    {"model": MODEL, "prompt": [1, 2, 3]},
    {"model": MODEL, "prompt": ["Once"]},
    {"model": MODEL, "prompt": [[1, 2]], "best_of": 1},
]  # fmt: skip
FN = {"type": "function", "name": "f", "description": "d", "parameters": SCHEMA, "strict": True}
RESPONSES = [
    {
        "model": MODEL,
        "input": [
            {"type": "message", "role": "developer", "content": "Be terse."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "18C"},
            {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Now"}]},
        ],
        "instructions": "Be kind.",
        "tools": [FN, {"type": "function", "name": "g", "parameters": SCHEMA}],
        "tool_choice": {"type": "function", "name": "g"},
        "text": {
            "format": {"type": "json_schema", "name": "out", "schema": SCHEMA, "strict": True},
            "verbosity": "low",
        },
        "reasoning": {"summary": "auto"},
        "include": ["message.output_text.logprobs"], "top_logprobs": 2, "max_output_tokens": 50,
        "max_tool_calls": 3, "temperature": 0.4, "top_p": 0.8, "stream": True, "background": False,
        "store": False, "metadata": {"k": "v"}, "parallel_tool_calls": True, "truncation": "auto",
        "user": "u", "safety_identifier": "s", "prompt_cache_key": "p", "service_tier": "auto",
    },
    {
        "model": MODEL,
        "input": "Reply in JSON",
        "reasoning": {"effort": "high", "summary": "detailed", "generate_summary": None},
        "text": {"format": {"type": "json_object"}},
        "tools": [FN],
        "tool_choice": "auto",
    },
    {
        "model": MODEL,
        "input": [
            {"type": "function_call_output", "call_id": "c0", "output": [{"type": "input_text", "text": "1"}]}
        ],
        "previous_response_id": "resp_1",
        "text": {"format": {"type": "regex", "regex": "a+"}},
        "reasoning": {"effort": "none"},
    },
]  # fmt: skip
TOOL = {"name": "f", "description": "d", "input_schema": SCHEMA, "strict": True}
USE = {"type": "tool_use", "id": "t1", "name": "f", "input": {"city": "a"}}
RESULT = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "18C"}]}
MESSAGES = [
    {
        "model": MODEL,
        "max_tokens": 100,
        "system": [{"type": "text", "text": "Be terse."}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm", "signature": "s"}, USE]},
            {"role": "user", "content": [{**RESULT, "is_error": False}, {"type": "text", "text": "Ok"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "It is"}]},
        ],
        "tools": [TOOL, {"name": "g", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
        "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
        "stop_sequences": ["x", ""], "temperature": 0.5, "top_p": 0.9, "top_k": 5,
        "metadata": {"user_id": "u"}, "stream": True, "service_tier": "auto",
    },
    {
        "model": MODEL,
        "max_tokens": 4096,
        "system": "Be kind.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "output_config": {"effort": "high"},
        "tools": [TOOL],
        "tool_choice": {"type": "auto"},
    },
]  # fmt: skip
COUNT_TOKENS = [{k: v for k, v in body.items() if k != "max_tokens"} for body in MESSAGES]
PARSERS: dict[str, tuple[Callable[[Any], object], list[dict[str, Any]]]] = {
    "chat": (parse_chat_request, CHAT),
    "completions": (parse_completion_request, COMPLETIONS),
    "responses": (parse_responses_request, RESPONSES),
    "messages": (parse_messages_request, MESSAGES),
    "count_tokens": (parse_count_tokens_request, COUNT_TOKENS),
}


def _nested(depth: int, leaf: Any, wrap: Callable[[Any], Any]) -> Any:
    for _ in range(depth):
        leaf = wrap(leaf)
    return leaf


BIG = "x" * 100_000
JUNK: list[Any] = [
    {}, [], None, True, False, 0, -1, 1, 2**31, 2**64, -(2**63) - 1, 10**300, 0.5, -0.0, 1e308,
    float("nan"), float("inf"), "", " ", "x", BIG, "\n", "none", "auto", "function", "text", "object",
    "json_schema", "user", "assistant", "tool", "message", "high", [None], [{}], [[]], {"type": {}},
    {"type": []}, {"type": "function"}, {"type": "text", "text": []}, {"": None},
]  # fmt: skip
# Deeply nested values are shared, never copied (deepcopy itself would overflow) nor mutated: the
# fuzzer does not descend into them, and parsers must not mutate what they are given.
DEEP: list[Any] = [
    _nested(5000, [], lambda x: [x]),
    _nested(5000, {}, lambda x: {"type": "object", "properties": {"a": x}}),
    _nested(5000, "x", lambda x: {"type": x}),
    _nested(800, [], lambda x: [x]),
    _nested(800, {}, lambda x: {"items": x}),
]
_DEEP_IDS = frozenset(map(id, DEEP))
KEYS = ["type", "role", "content", "name", "text", "function", "schema", "strict", "effort", "zzz", BIG]


def _slots(value: Any, depth: int = 0) -> list[tuple[Any, Any]]:
    """Every (container, key-or-index) below ``value``, down to the seeds' depth."""
    out: list[tuple[Any, Any]] = []
    if depth > 12 or id(value) in _DEEP_IDS:
        return out
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        out.append((value, key))
        out.extend(_slots(child, depth + 1))
    return out


def _containers(body: dict[str, Any]) -> list[Any]:
    return [body] + [c[k] for c, k in _slots(body) if isinstance(c[k], dict | list)]


def _junk(rng: random.Random) -> Any:
    if rng.random() < 0.1:
        return rng.choice(DEEP)
    return copy.deepcopy(rng.choice(JUNK))


def _mutate(rng: random.Random, body: dict[str, Any], seeds: list[dict[str, Any]]) -> str:
    """One random change to ``body`` in place; returns what it did, for the failure message."""
    op = rng.choice(("junk", "junk", "junk", "delete", "add", "wrap", "graft", "swap"))
    slots = _slots(body)
    if op in ("add", "delete") or not slots:
        container = rng.choice(_containers(body))
        if op == "delete" and container:
            key = rng.choice(list(container) if isinstance(container, dict) else range(len(container)))
            del container[key]
            return f"delete {key!r}"
        junk = _junk(rng)
        if isinstance(container, dict):
            key = rng.choice(KEYS)
            container[key] = junk
            return f"add {key[:20]!r}"
        container.append(junk)
        return "append junk"
    container, key = rng.choice(slots)
    if op == "wrap":
        container[key] = [container[key]]
    elif op == "graft":
        donor = copy.deepcopy(rng.choice(seeds))
        donor_slots = _slots(donor)
        if donor_slots:
            src, src_key = rng.choice(donor_slots)
            container[key] = src[src_key]
    elif op == "swap" and isinstance(container[key], str):
        container[key] = rng.choice(["", "none", "function", "object", "x" * 70, "a\nb", "f"])
    else:
        container[key] = _junk(rng)
    return f"{op} at {key!r:.20}"


@pytest.mark.parametrize("name", list(PARSERS))
def test_seed_bodies_are_valid(name: str) -> None:
    parse, seeds = PARSERS[name]
    for seed in seeds:
        parse(copy.deepcopy(seed))


@pytest.mark.parametrize("name", list(PARSERS))
def test_any_bad_body_is_an_api_error(name: str) -> None:
    parse, seeds = PARSERS[name]
    rng = random.Random(f"api-fuzz-{name}")
    for case in range(CASES_PER_PARSER):
        body = copy.deepcopy(rng.choice(seeds))
        steps = [_mutate(rng, body, seeds) for _ in range(rng.choice((1, 1, 2, 3)))]
        try:
            parse(body)
        except ApiError as err:
            assert err.status == 400, (case, steps, err.status)
            assert isinstance(err.message, str) and err.message, (case, steps)
            assert err.param is None or isinstance(err.param, str), (case, steps)
        except Exception as exc:  # the bug this test is for: anything else is a 500
            pytest.fail(f"case {case} {steps}: {type(exc).__name__}: {str(exc)[:200]}")
