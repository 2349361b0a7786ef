"""Our request models against the deepseek-recipe wheel: for bodies both accept, the Conversation
must match the wheel's converted conversation field by field.

Normalisations, each a documented representation choice rather than a behaviour difference:
- ``thinking=None`` (model default) is the wheel's default, on; ``effort=None`` with thinking on
  is the wheel's default level, "high".
- an assistant turn's missing reasoning is ``None`` here; the wheel fills "" in thinking mode (its
  FillEmpty option), and the DeepSeek format renders ``None`` so. With thinking explicitly off both
  drop every turn's reasoning.
- a non-strict tool without parameters is ``None`` here, ``{}`` in the wheel; the format renders ``{}``.
- a Responses developer message keeps the role "developer" here; the wheel converts it per model
  version (V4.1, MODEL here: system; V4: user), as the DeepSeek format renders it.
- a strict tool's objects get the wheel's key order (type, properties, additionalProperties,
  required); the wheel also re-serialises other keywords in its own order and drops those it does not
  model ($defs, title, ...), where we keep the client's schema (test_api_chat: strict keeps $defs).
"""

from __future__ import annotations

from typing import Any

import pytest

from libs.recipe.api import parse_chat_request, parse_messages_request, parse_responses_request
from libs.recipe.conversation import Conversation
from tests.unit.recipe.api_helpers import MODEL, USER

dr = pytest.importorskip("deepseek_recipe")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"],
}
WEATHER_ALL = {**WEATHER, "required": ["city", "unit"]}  # the wheel refuses partial required in strict
NESTED = {
    "type": "object",
    "properties": {
        "query": {"type": "object", "properties": {"text": {"type": "string"}}},
        "filters": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "mode": {"anyOf": [{"type": "object", "properties": {"x": {"type": "integer"}}}, {"type": "null"}]},
    },
}


def _effective(ours: Conversation) -> bool:
    return True if ours.thinking is None else ours.thinking


def assert_same(ours: Conversation, wheel: Any) -> None:
    thinking = _effective(ours)
    assert thinking == wheel.thinking_mode
    assert (ours.effort or ("high" if thinking else None)) == wheel.reasoning_effort
    assert ours.tool_choice == wheel.tool_choice
    assert ours.response_format == wheel.response_format
    assert ours.response_schema == wheel.response_schema
    assert ours.response_regex == wheel.response_regex
    assert len(ours.tools) == len(wheel.tools)
    for tool, theirs in zip(ours.tools, wheel.tools, strict=True):
        assert (tool.name, tool.description, tool.strict) == (theirs.name, theirs.description, theirs.strict)
        assert (tool.parameters if tool.parameters is not None else {}) == theirs.parameters
    roles = ["system" if m.role == "developer" else m.role for m in ours.messages]
    assert roles == [m.role for m in wheel.messages]
    for mine, theirs in zip(ours.messages, wheel.messages, strict=True):
        assert mine.content == theirs.content
        assert mine.tool_call_id == theirs.tool_call_id
        calls = [(c.id, c.name, c.arguments) for c in theirs.tool_calls or []]
        assert [(c.id, c.name, c.arguments) for c in mine.tool_calls] == calls
        if mine.role == "assistant":
            assert mine.prefix == theirs.prefix
            mine_reasoning = mine.reasoning or "" if thinking else mine.reasoning
            assert mine_reasoning == (theirs.reasoning_content or "" if thinking else None)


def _wheel(kind: Any, body: dict[str, Any]) -> Any:
    return kind(body).convert(dr.ConversionOptions()).conversation


def _tool(
    name: str, parameters: Any = None, strict: bool | None = None, description: str | None = None
) -> Any:
    given = {"parameters": parameters, "strict": strict, "description": description}
    function = {"name": name, **{key: value for key, value in given.items() if value is not None}}
    return {"type": "function", "function": function}


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


TOOL_LOOP = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Two cities: two calls.",
        "tool_calls": [
            _call("c1", "weather", '{"city": "Paris"}'),
            _call("c2", "weather", '{"city": "Rome"}'),
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    {
        "role": "tool",
        "tool_call_id": "c2",
        "content": [{"type": "text", "text": "21C"}, {"type": "text", "text": "sun"}],
    },
    {"role": "assistant", "content": "Paris 18C, Rome 21C.", "reasoning_content": "Done."},
    {"role": "user", "content": "Thanks"},
]
CHAT = {
    "plain": {"messages": USER},
    "system_parts": {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": [{"type": "text", "text": "c"}, {"type": "text", "text": "d"}]},
        ]
    },
    "multi_turn_mid_system": {
        "messages": [
            {"role": "user", "content": "1"},
            {"role": "assistant", "content": "2", "reasoning_content": "r"},
            {"role": "system", "content": "new rule"},
            {"role": "user", "content": "3"},
            {"role": "latest_reminder", "content": "be brief"},
        ]
    },
    "thinking_off": {"messages": [{"role": "user", "content": "Hi"}], "thinking": {"type": "disabled"}},
    "thinking_on": {"messages": [{"role": "user", "content": "Hi"}], "thinking": {"type": "enabled"}},
    "thinking_on_effort_none": {
        "messages": [{"role": "user", "content": "Hi"}],
        "thinking": {"type": "enabled"},
        "reasoning_effort": "none",
    },
    "thinking_off_effort_max": {
        "messages": [{"role": "user", "content": "Hi"}],
        "thinking": {"type": "disabled"},
        "reasoning_effort": "max",
    },
    **{
        f"effort_{e}": {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": e}
        for e in ("none", "minimal", "low", "medium", "high", "xhigh", "max")
    },
    "tool_loop": {"messages": TOOL_LOOP, "tools": [_tool("weather", WEATHER, description="Get weather")]},
    "tool_loop_off": {
        "messages": TOOL_LOOP,
        "tools": [_tool("weather", WEATHER)],
        "thinking": {"type": "disabled"},
    },
    "no_reasoning_in_history": {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [_call("c1", "weather", "{}")]},
            {"role": "tool", "tool_call_id": "c1", "content": "x"},
        ],
        "tools": [_tool("weather", WEATHER), _tool("noop")],
    },
    "tool_choice_none": {"messages": TOOL_LOOP, "tools": [_tool("weather", WEATHER)], "tool_choice": "none"},
    "tool_choice_required_off": {
        "messages": [{"role": "user", "content": "q"}],
        "tools": [_tool("weather", WEATHER), _tool("noop")],
        "tool_choice": "required",
        "thinking": {"type": "disabled"},
    },
    "tool_choice_named_off": {
        "messages": [{"role": "user", "content": "q"}],
        "tools": [_tool("weather", WEATHER), _tool("noop")],
        "tool_choice": {"type": "function", "function": {"name": "noop"}},
        "reasoning_effort": "none",
    },
    "strict_tools": {
        "messages": [{"role": "user", "content": "q"}],
        "tools": [
            _tool("weather", WEATHER_ALL, strict=True),
            _tool("search", NESTED, strict=True),
            _tool("noop", strict=True),
        ],
    },
    "strict_false": {
        "messages": [{"role": "user", "content": "q"}],
        "tools": [_tool("weather", WEATHER, strict=False)],
    },
    "prefix": {
        "messages": [
            {"role": "user", "content": "Count"},
            {"role": "assistant", "content": "1, 2,", "prefix": True},
        ],
        "thinking": {"type": "disabled"},
        "stop": ["5"],
    },
    "prefix_thinking": {
        "messages": [
            {"role": "user", "content": "Count"},
            {"role": "assistant", "content": "1,", "reasoning_content": "easy", "prefix": True},
        ],
    },
    "json_object": {
        "messages": [{"role": "user", "content": "Reply in JSON"}],
        "response_format": {"type": "json_object"},
    },
    "json_schema": {
        "messages": [{"role": "user", "content": "weather"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": WEATHER_ALL, "strict": True},
        },
    },
    "regex": {
        "messages": [{"role": "user", "content": "digits"}],
        "response_format": {"type": "regex", "regex": "[0-9]+"},
    },
    "sampling": {
        "messages": [{"role": "user", "content": "Hi"}],
        "temperature": 0.3,
        "top_p": 0.9,
        "max_tokens": 100,
        "seed": 7,
        "logprobs": True,
        "top_logprobs": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
}


@pytest.mark.parametrize("name", list(CHAT))
def test_chat_matches_wheel(name: str) -> None:
    body = {"model": MODEL, **CHAT[name]}
    assert_same(parse_chat_request(body).conversation, _wheel(dr.ChatCompletionRequest, body))


FN = {"type": "function", "name": "weather", "description": "Get weather", "parameters": WEATHER}
RESPONSES = {
    "string": {"input": "Hi", "instructions": "Be terse."},
    "items": {
        "instructions": "Be terse.",
        "input": [
            {"role": "developer", "content": "dev rule"},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "think"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "let me check"}],
            },
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city":"Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "18C"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "21C"}],
            },
            {"role": "assistant", "content": "a1"},
            {"role": "assistant", "content": "a2"},
            {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "s"}]},
            {"role": "assistant", "content": "a3"},
            {"role": "system", "content": "mid system"},
            {"role": "user", "content": "next"},
        ],
        "tools": [FN],
    },
    "two_reasoning_items": {
        "input": [
            {"role": "user", "content": "q"},
            {
                "type": "reasoning",
                "id": "r1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "x"}],
            },
            {
                "type": "reasoning",
                "id": "r2",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "y"}],
            },
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "q2"},
        ],
    },
    **{
        f"effort_{e}": {"input": "Hi", "reasoning": {"effort": e, "summary": "auto"}}
        for e in ("none", "low", "medium", "high", "xhigh", "max")
    },
    "strict_tool": {"input": "q", "tools": [{**FN, "parameters": WEATHER_ALL, "strict": True}]},
    "named_tool_off": {
        "input": "q",
        "tools": [FN, {"type": "function", "name": "noop"}],
        "tool_choice": {"type": "function", "name": "weather"},
        "reasoning": {"effort": "none"},
    },
    "tool_choice_none": {"input": "q", "tools": [FN], "tool_choice": "none"},
    "json_object": {"input": "answer in json", "text": {"format": {"type": "json_object"}}},
    "json_schema": {
        "input": "q",
        "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER_ALL, "strict": True}},
    },
    "sampling": {"input": "q", "max_output_tokens": 50, "temperature": 0.2, "top_p": 0.5, "store": False},
}


@pytest.mark.parametrize("name", list(RESPONSES))
def test_responses_matches_wheel(name: str) -> None:
    body = {"model": MODEL, **RESPONSES[name]}
    assert_same(parse_responses_request(body).conversation(), _wheel(dr.ResponsesRequest, body))


TOOL = {"name": "weather", "description": "Get weather", "input_schema": WEATHER}
LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "call it", "signature": "sig"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris", "unit": "é"}},
            {
                "type": "tool_use",
                "id": "t2",
                "name": "weather",
                "input": {"city": "Rome", "n": [1, 2.5, None]},
            },
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "18C"},
            {
                "type": "tool_result",
                "tool_use_id": "t2",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                "is_error": True,
            },
            {"type": "text", "text": "and now?"},
        ],
    },
]
MESSAGES = {
    "plain": {"system": "Be terse.", "messages": [{"role": "user", "content": "Hi"}]},
    "system_blocks": {
        "system": [
            {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "b"},
        ],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    },
    "tool_loop": {"tools": [TOOL], "messages": LOOP},
    "thinking_off": {"thinking": {"type": "disabled"}, "messages": LOOP, "tools": [TOOL]},
    "thinking_enabled_budget": {
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": LOOP,
        "tools": [TOOL],
    },
    "adaptive": {"thinking": {"type": "adaptive"}, "messages": [{"role": "user", "content": "Hi"}]},
    **{
        f"effort_{e}": {"output_config": {"effort": e}, "messages": [{"role": "user", "content": "Hi"}]}
        for e in ("low", "medium", "high", "max")
    },
    "tool_named_off": {
        "thinking": {"type": "disabled"},
        "tools": [TOOL, {"name": "noop", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "weather"},
        "messages": [{"role": "user", "content": "q"}],
    },
    "tool_choice_none": {
        "tools": [TOOL],
        "tool_choice": {"type": "none"},
        "messages": [{"role": "user", "content": "q"}],
    },
    "sampling": {
        "messages": [{"role": "user", "content": "q"}],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 5,
        "stop_sequences": ["x"],
        "metadata": {"user_id": "u"},
    },
}


@pytest.mark.parametrize("name", list(MESSAGES))
def test_messages_matches_wheel(name: str) -> None:
    body = {"model": MODEL, "max_tokens": 4096, **MESSAGES[name]}
    assert_same(parse_messages_request(body).conversation, _wheel(dr.MessagesRequest, body))
