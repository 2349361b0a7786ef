"""Chat Completions request model: deliberate differences from the wheel, and bad inputs -> 400."""

from __future__ import annotations

from typing import Any

import pytest

from libs.protocol.messages import TokenBias
from libs.recipe.api import parse_chat_request
from libs.recipe.fields import ApiError
from libs.recipe.sampling import MAX_LOGIT_BIAS
from tests.unit.recipe.api_helpers import MODEL, USER, assert_names_field, rejected

dr = pytest.importorskip("deepseek_recipe")

OBJ = {"type": "object", "properties": {"a": {"type": "string"}}}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **fields}


def tool(name: str = "f", **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **function}}


def call(call_id: str = "c1", name: str = "f") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}


def error(request: dict[str, Any]) -> ApiError:
    return rejected(parse_chat_request, request)


# --- deliberate differences from the wheel ---------------------------------------------------


def test_developer_role_is_a_system_turn_which_the_wheel_rejects() -> None:
    request = body(messages=[{"role": "developer", "content": "rule"}, *USER])
    assert parse_chat_request(request).conversation.messages[0].role == "system"
    with pytest.raises(ValueError, match="developer"):
        dr.ChatCompletionRequest(request).convert(dr.ConversionOptions())


def test_n_above_one_is_accepted_where_the_wheel_allows_only_one() -> None:
    assert parse_chat_request(body(n=3)).sampling.n == 3
    with pytest.raises(dr.ConversionError):
        dr.ChatCompletionRequest(body(n=3)).convert(dr.ConversionOptions())


def test_unknown_field_is_rejected_like_openai_where_the_wheel_ignores_it() -> None:
    err = error(body(foo=1))
    assert (err.message, err.param) == ("Unrecognized request argument supplied: foo", "foo")
    dr.ChatCompletionRequest(body(foo=1)).convert(dr.ConversionOptions())


def test_logit_bias_is_read_sorted_by_token_id() -> None:
    request = parse_chat_request(body(logit_bias={"300": -100, "7": 2.5, "0": 0}))
    assert request.sampling.base.logit_bias == (TokenBias(0, 0.0), TokenBias(7, 2.5), TokenBias(300, -100.0))
    assert parse_chat_request(body(logit_bias={})).sampling.base.logit_bias == ()


def test_max_completion_tokens_is_honoured() -> None:
    assert parse_chat_request(body(max_completion_tokens=5)).sampling.max_tokens == 5


def test_thinking_left_to_the_model_default_allows_a_forced_tool() -> None:
    # The wheel assumes thinking on and refuses; None leaves it to the format.
    conversation = parse_chat_request(body(tools=[tool()], tool_choice="required")).conversation
    assert (conversation.thinking, conversation.tool_choice) == (None, "required")


def test_strict_tool_with_partial_required_is_normalised_not_refused() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
        "required": ["a"],
    }
    params = (
        parse_chat_request(body(tools=[tool(parameters=schema, strict=True)]))
        .conversation.tools[0]
        .parameters
    )
    assert params["required"] == ["a", "b"] and params["additionalProperties"] is False
    assert schema["required"] == ["a"]  # the client's dict is not mutated


def test_strict_keeps_and_closes_defs() -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": OBJ}}
    params = (
        parse_chat_request(body(tools=[tool(parameters=schema, strict=True)]))
        .conversation.tools[0]
        .parameters
    )
    assert params["$defs"]["A"]["additionalProperties"] is False and params["$defs"]["A"]["required"] == ["a"]


def test_extensions() -> None:
    request = parse_chat_request(
        body(chat_template_kwargs={"enable_thinking": False}, top_k=5, min_p=0.1, stream=True,
             stream_options={"include_usage": True}, user="u", metadata={"k": "v"}, store=True,
             service_tier="auto", prompt_cache_key="p", parallel_tool_calls=False, seed=1)
    )  # fmt: skip
    assert request.conversation.extra == {"enable_thinking": False}
    assert (request.stream, request.include_usage) == (True, True)
    assert request.sampling.base.top_k == 5


def test_prefix_and_reasoning_content() -> None:
    messages = [*USER, {"role": "assistant", "content": "So", "reasoning_content": "r", "prefix": True}]
    last = parse_chat_request(body(messages=messages)).conversation.messages[-1]
    assert (last.prefix, last.reasoning, last.content) == (True, "r", "So")


def test_named_tool_choice_restricts_tools_and_requires_a_call() -> None:
    choice = {"type": "function", "function": {"name": "g"}}
    conversation = parse_chat_request(body(tools=[tool("f"), tool("g")], tool_choice=choice)).conversation
    assert conversation.tool_choice == "required" and [t.name for t in conversation.tools] == ["g"]


def test_json_schema_output_format_sets_the_schema() -> None:
    spec = {"type": "json_schema", "json_schema": {"name": "out", "schema": OBJ, "strict": True}}
    conversation = parse_chat_request(body(response_format=spec)).conversation
    assert (conversation.response_format, conversation.response_schema) == ("json_schema", OBJ)


# --- bad inputs --------------------------------------------------------------------------------

BAD: dict[str, tuple[dict[str, Any], str, str]] = {
    "body": ({}, "model", "'model' is required"),
    "role": (body(messages=[{"role": "bot", "content": "x"}]), "messages[0].role", "must be one of"),
    "empty": (body(messages=[]), "messages", "must not be empty"),
    "image_url_scheme": (
        body(
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///x"}}]}]
        ),
        "messages[0].content[0].image_url.url",
        "http(s) URL",
    ),
    "image_in_system": (
        body(messages=[{"role": "system", "content": [{"type": "image_url", "image_url": "http://x"}]}]),
        "messages[0].content[0]",
        "only allowed in messages with role 'user'",
    ),
    "audio": (
        body(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]),
        "messages[0].content[0]",
        "audio input is not supported",
    ),
    "orphan_tool": (
        body(messages=[*USER, {"role": "tool", "tool_call_id": "c1", "content": "x"}]),
        "messages[1]",
        "must be a response to a preceding message with 'tool_calls'",
    ),
    "wrong_tool_id": (
        body(
            messages=[
                *USER,
                {"role": "assistant", "content": None, "tool_calls": [call()]},
                {"role": "tool", "tool_call_id": "zz", "content": "x"},
            ]
        ),
        "messages[2]",
        "'tool_call_id' of 'zz' not found",
    ),
    "unanswered": (
        body(
            messages=[
                *USER,
                {"role": "assistant", "content": None, "tool_calls": [call("c1"), call("c2")]},
                {"role": "tool", "tool_call_id": "c1", "content": "x"},
                *USER,
            ]
        ),
        "messages[1]",
        "did not have response messages: c2",
    ),
    "unanswered_at_end": (
        body(messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [call()]}]),
        "messages[1]",
        "must be followed by tool messages",
    ),
    "tool_call_type": (
        body(messages=[*USER, {"role": "assistant", "tool_calls": [{**call(), "type": "custom"}]}]),
        "messages[1].tool_calls[0].type",
        "must be 'function'",
    ),
    "tool_call_arguments": (
        body(
            messages=[
                *USER,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}],
                },
            ]
        ),
        "messages[1].tool_calls[0].function.arguments",
        "must be a string",
    ),
    "prefix_not_last": (
        body(messages=[*USER, {"role": "assistant", "content": "a", "prefix": True}, *USER]),
        "messages[1].prefix",
        "Only the last message",
    ),
    "assistant_empty": (body(messages=[*USER, {"role": "assistant"}]), "messages[1].content", "must be set"),
    "tool_name": (body(tools=[tool("a b")]), "tools[0].function.name", "does not match pattern"),
    "tool_type": (
        body(tools=[{"type": "custom", "function": {"name": "f"}}]),
        "tools[0].type",
        "must be 'function'",
    ),
    "tool_params_array": (
        body(tools=[tool(parameters={"type": "array"})]),
        "tools[0].function.parameters",
        'type: "object"',
    ),
    "tool_params_string": (body(tools=[tool(parameters="x")]), "tools[0].function.parameters", "JSON Schema"),
    "strict_open_object": (
        body(tools=[tool(parameters={**OBJ, "additionalProperties": True}, strict=True)]),
        "tools[0].function.parameters",
        "additionalProperties must be false",
    ),
    "duplicate_tools": (body(tools=[tool(), tool()]), "tools", "unique"),
    "unknown_named_tool": (
        body(
            tools=[tool()],
            tool_choice={"type": "function", "function": {"name": "g"}},
            thinking={"type": "disabled"},
        ),
        "tool_choice",
        "no function named 'g'",
    ),
    "required_without_tools": (body(tool_choice="required"), "tool_choice", "only allowed when 'tools'"),
    "thinking_forced_tool": (
        body(tools=[tool()], tool_choice="required", thinking={"type": "enabled"}),
        "tool_choice",
        "Thinking mode does not support this tool_choice",
    ),
    "effort_implies_thinking": (
        body(tools=[tool()], tool_choice="required", reasoning_effort="high"),
        "tool_choice",
        "Thinking mode does not support",
    ),
    "effort_value": (body(reasoning_effort="ultra-max"), "reasoning_effort", "must be one of"),
    "thinking_type": (body(thinking={"type": "on"}), "thinking.type", "must be one of"),
    "json_word": (body(response_format={"type": "json_object"}), "messages", "must contain the word 'json'"),
    "json_schema_missing": (
        body(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        "response_format.json_schema.schema",
        "required",
    ),
    "format_type": (body(response_format={"type": "xml"}), "response_format.type", "must be one of"),
    "regex_empty": (
        body(response_format={"type": "regex", "regex": ""}),
        "response_format.regex",
        "non-empty",
    ),
    "logit_bias_type": (body(logit_bias=[1, 2]), "logit_bias", "must be an object"),
    "logit_bias_key": (body(logit_bias={"x": 1}), "logit_bias", "'x' is not a token id"),
    "logit_bias_negative_key": (body(logit_bias={"-1": 1}), "logit_bias", "is not a token id"),
    "logit_bias_huge_key": (body(logit_bias={"9" * 30: 1}), "logit_bias", "is not a token id"),
    "logit_bias_value": (body(logit_bias={"1": 100.5}), "logit_bias", "[-100, 100]"),
    "logit_bias_bool": (body(logit_bias={"1": True}), "logit_bias", "[-100, 100]"),
    "logit_bias_nan": (body(logit_bias={"1": float("nan")}), "logit_bias", "[-100, 100]"),
    "logit_bias_twice": (body(logit_bias={"7": 1, "007": 2}), "logit_bias", "token 7 twice"),
    "logit_bias_size": (
        body(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}),
        "logit_bias",
        f"at most {MAX_LOGIT_BIAS}",
    ),
    "temperature": (body(temperature=3), "temperature", "must be in"),
    "max_tokens": (body(max_tokens=0), "max_tokens", "between 1"),
    "n": (body(n=100), "n", "between 1"),
    "modalities": (body(modalities=["audio"]), "modalities", "text"),
    "template_kwargs": (body(chat_template_kwargs=[1]), "chat_template_kwargs", "must be an object"),
    "prediction": (body(prediction="x"), "prediction", "must be an object"),
    "prediction_type": (body(prediction={"type": "text", "content": "x"}), "prediction.type", "'content'"),
    "prediction_field": (body(prediction={"type": "content", "content": "", "x": 1}), "prediction.x", "x"),
    "prediction_content": (
        body(prediction={"type": "content", "content": 3}),
        "prediction.content",
        "string",
    ),
    "prediction_part": (
        body(prediction={"type": "content", "content": [{"type": "image_url"}]}),
        "prediction.content[0]",
        "type 'text'",
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_a_400_naming_the_field(name: str) -> None:
    assert_names_field(parse_chat_request, *BAD[name])


@pytest.mark.parametrize(
    "content",
    [
        "def f():\n    return 1\n",
        [{"type": "text", "text": "def f():\n"}, {"type": "text", "text": "    return 1\n"}],
    ],
)
def test_a_prediction_is_its_text_in_a_string_or_text_parts(content: Any) -> None:
    request = parse_chat_request(body(prediction={"type": "content", "content": content}))
    assert request.prediction == "def f():\n    return 1\n"
    assert parse_chat_request(body()).prediction == parse_chat_request(body(prediction=None)).prediction == ""
