"""Responses request model: history chaining, echo, deliberate differences, bad inputs -> 400."""

from __future__ import annotations

from typing import Any

import pytest

from libs.recipe.api import parse_responses_request
from libs.recipe.conversation import Message, ToolCall
from libs.recipe.fields import ApiError
from tests.unit.recipe.api_helpers import MODEL, assert_names_field, rejected

dr = pytest.importorskip("deepseek_recipe")

FN = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "Hi", **fields}


def error(request: dict[str, Any]) -> ApiError:
    return rejected(parse_responses_request, request)


def test_instructions_lead_but_are_not_history() -> None:
    request = parse_responses_request(body(instructions="Be terse."))
    assert request.input_messages == (Message("user", "Hi"),)
    history = (Message("user", "Earlier"), Message("assistant", "Sure"))
    messages = request.conversation(history).messages
    assert [m.content for m in messages] == ["Be terse.", "Earlier", "Sure", "Hi"]
    assert messages[0].role == "system"


def test_previous_response_id_defers_the_tool_check_to_the_history() -> None:
    output = {"type": "function_call_output", "call_id": "c1", "output": "18C"}
    request = parse_responses_request(body(input=[output], previous_response_id="resp_1", tools=[FN]))
    history = (Message("user", "q"), Message("assistant", "", tool_calls=(ToolCall("c1", "f", "{}"),)))
    assert request.conversation(history).messages[-1] == Message("tool", "18C", tool_call_id="c1")
    with pytest.raises(ApiError, match="No tool call found for function call output with call_id c1") as info:
        request.conversation()
    assert info.value.param == "input[0]"


def test_echo_has_openai_defaults() -> None:
    echo = parse_responses_request(body()).echo()
    assert echo["store"] is True and echo["tool_choice"] == "auto" and echo["truncation"] == "disabled"
    assert echo["text"] == {"format": {"type": "text"}} and echo["parallel_tool_calls"] is True
    assert (echo["temperature"], echo["top_p"], echo["previous_response_id"]) == (1.0, 1.0, None)
    assert (echo["prompt_cache_key"], echo["prompt_cache_retention"]) == (None, None)


def test_echo_repeats_the_request() -> None:
    fmt = {"type": "json_schema", "name": "o", "schema": {"type": "object"}, "strict": False}
    fields = {
        "tools": [FN], "tool_choice": "none", "text": {"format": fmt, "verbosity": "low"},
        "reasoning": {"effort": "low"}, "temperature": 0.5, "store": False, "metadata": {"k": "v"},
        "max_output_tokens": 64, "truncation": "auto", "background": True, "instructions": "I",
        "prompt_cache_key": "user-7", "prompt_cache_retention": "24h",
    }  # fmt: skip
    request = parse_responses_request(body(**fields))
    echo = request.echo()
    assert echo["tools"] == [FN] and echo["text"] == {"format": fmt, "verbosity": "low"}
    assert echo["reasoning"] == {"effort": "low", "summary": None}
    assert (echo["store"], echo["max_output_tokens"], echo["background"], echo["instructions"]) == (
        False,
        64,
        True,
        "I",
    )
    assert request.sampling.max_tokens == 64 and request.sampling.base.temperature == 0.5
    assert (echo["prompt_cache_key"], echo["prompt_cache_retention"]) == ("user-7", "24h")


def test_logprobs_come_from_include() -> None:
    request = parse_responses_request(body(include=["message.output_text.logprobs"], top_logprobs=2))
    assert (request.sampling.base.logprobs, request.sampling.base.top_logprobs) == (True, 2)


def test_top_logprobs_zero_without_include_is_accepted() -> None:
    request = parse_responses_request(body(top_logprobs=0))
    assert (request.sampling.base.logprobs, request.sampling.base.top_logprobs) == (False, 0)


def test_the_conversation_checked_at_parse_time_is_reused_without_history() -> None:
    request = parse_responses_request(body(instructions="Be terse."))
    assert request.conversation() is request.conversation(()) is request.checked
    assert [m.content for m in request.conversation((Message("user", "Earlier"),)).messages] == [
        "Be terse.",
        "Earlier",
        "Hi",
    ]


def test_regex_format_is_accepted() -> None:
    request = parse_responses_request(body(text={"format": {"type": "regex", "regex": "[0-9]+"}}))
    assert request.conversation().response_regex == "[0-9]+"


def test_web_search_is_refused_where_the_wheel_drops_it() -> None:
    assert error(body(tools=[{"type": "web_search"}])).param == "tools[0].type"
    dr.ResponsesRequest(body(tools=[{"type": "web_search"}])).convert(dr.ConversionOptions())


def test_item_reference_is_refused_where_the_wheel_drops_it() -> None:
    assert error(body(input=[{"type": "item_reference", "id": "x"}])).param == "input[0].type"


BAD: dict[str, tuple[dict[str, Any], str, str]] = {
    "unknown": (body(foo=1), "foo", "Unknown parameter: 'foo'."),
    "input_missing": ({"model": MODEL}, "input", "'input' is required"),
    "role": (body(input=[{"role": "tool", "content": "x"}]), "input[0].role", "must be one of"),
    "image_url": (
        body(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]),
        "input[0].content[0].image_url",
        "http(s) URL",
    ),
    "image_file_id": (
        body(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]),
        "input[0].content[0].file_id",
        "no file store",
    ),
    "file": (
        body(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]),
        "input[0].content[0]",
        "file input",
    ),
    "unanswered": (
        body(
            input=[
                {"role": "user", "content": "q"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            ],
            tools=[FN],
        ),
        "input[1]",
        "No tool output found for function call c1.",
    ),
    "orphan": (
        body(input=[{"type": "function_call_output", "call_id": "c9", "output": "x"}]),
        "input[0]",
        "No tool call found",
    ),
    "call_id": (
        body(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]),
        "input[0].call_id",
        "required",
    ),
    "tool_name": (body(tools=[{**FN, "name": "bad name"}]), "tools[0].name", "does not match pattern"),
    "tool_choice": (body(tools=[FN], tool_choice={"type": "allowed_tools"}), "tool_choice", "must be"),
    "named_unknown": (
        body(tools=[FN], tool_choice={"type": "function", "name": "g"}),
        "tool_choice",
        "no function named 'g'",
    ),
    "thinking_forced": (
        body(tools=[FN], tool_choice="required", reasoning={"effort": "high"}),
        "tool_choice",
        "Thinking mode",
    ),
    "effort": (body(reasoning={"effort": "huge"}), "reasoning.effort", "must be one of"),
    "json_word": (
        body(text={"format": {"type": "json_object"}}),
        "text.format",
        "must contain the word 'json'",
    ),
    "format": (body(text={"format": {"type": "yaml"}}), "text.format.type", "'json_schema', 'regex'"),
    "max_output_tokens": (body(max_output_tokens=0), "max_output_tokens", "between 1"),
    "top_logprobs": (body(top_logprobs=21), "top_logprobs", "between 0 and 20"),
    "temperature": (body(temperature=2.5), "temperature", "must be in"),
    "truncation": (body(truncation="middle"), "truncation", "must be one of"),
    "store": (body(store="yes"), "store", "boolean"),
    "prompt": (body(prompt={"id": "p"}), "prompt", "not supported"),
    "include": (body(include="x"), "include", "array of strings"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_a_400_naming_the_field(name: str) -> None:
    assert_names_field(parse_responses_request, *BAD[name])
