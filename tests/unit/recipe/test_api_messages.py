"""Messages request model: Anthropic semantics where the wheel differs, and bad inputs -> 400."""

from __future__ import annotations

from typing import Any

import pytest

from libs.recipe.api import parse_count_tokens_request, parse_messages_request
from libs.recipe.fields import ApiError
from tests.unit.recipe.api_helpers import MODEL, USER, assert_names_field, rejected

dr = pytest.importorskip("deepseek_recipe")

TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "string"}}}}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 2048, "messages": USER, **fields}


def wheel(request: dict[str, Any]) -> Any:
    return dr.MessagesRequest(request).convert(dr.ConversionOptions()).conversation


def error(request: dict[str, Any]) -> ApiError:
    return rejected(parse_messages_request, request)


def test_any_means_required_where_the_wheel_says_auto() -> None:
    request = body(tools=[TOOL], tool_choice={"type": "any"}, thinking={"type": "disabled"})
    assert parse_messages_request(request).conversation.tool_choice == "required"
    assert wheel(request).tool_choice == "auto"


def test_final_assistant_is_a_prefill_where_the_wheel_starts_a_new_turn() -> None:
    request = body(messages=[*USER, {"role": "assistant", "content": "The answer is"}])
    last = parse_messages_request(request).conversation.messages[-1]
    assert (last.role, last.content, last.prefix) == ("assistant", "The answer is", True)
    assert wheel(request).messages[-1].prefix is False


def test_max_tokens_is_required_where_the_wheel_accepts_none() -> None:
    request = {"model": MODEL, "messages": USER}
    assert error(request).param == "max_tokens"
    assert parse_count_tokens_request(request).sampling.max_tokens is None
    wheel(request)


def test_user_text_blocks_are_joined_where_the_wheel_splits_them() -> None:
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = body(messages=[{"role": "user", "content": content}])
    assert [m.content for m in parse_messages_request(request).conversation.messages] == ["a\n\nb"]
    assert [m.content for m in wheel(request).messages] == ["a", "b"]


def test_strict_tool_is_closed_but_keeps_optional_properties() -> None:
    tool = parse_messages_request(body(tools=[{**TOOL, "strict": True}])).conversation.tools[0]
    assert tool.strict is True and tool.parameters["additionalProperties"] is False
    assert "required" not in tool.parameters


def test_output_config_format_is_a_json_schema() -> None:
    schema = {"type": "object", "properties": {}}
    config = {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}
    conversation = parse_messages_request(body(output_config=config)).conversation
    assert (conversation.response_format, conversation.response_schema, conversation.effort) == (
        "json_schema",
        schema,
        "low",
    )


def test_effort_does_not_switch_thinking_on() -> None:
    conversation = parse_messages_request(body(output_config={"effort": "max"})).conversation
    assert (conversation.thinking, conversation.effort) == (None, "max")


def test_sampling_and_metadata() -> None:
    request = parse_messages_request(
        body(temperature=0.5, top_k=4, stop_sequences=["x", ""], metadata={"user_id": "u"}, stream=True)
    )
    assert (request.sampling.base.temperature, request.sampling.base.top_k, request.sampling.stop) == (
        0.5,
        4,
        ["x"],
    )
    assert (request.stream, request.sampling.max_tokens) == (True, 2048)


USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}
BAD: dict[str, tuple[dict[str, Any], str, str]] = {
    "unknown": (body(foo=1), "foo", "foo: Extra inputs are not permitted"),
    "max_tokens_zero": (body(max_tokens=0), "max_tokens", "between 1"),
    "temperature": (body(temperature=1.5), "temperature", "[0.0, 1.0]"),
    "role": (
        body(messages=[{"role": "system", "content": "x"}]),
        "messages[0].role",
        "'user' or 'assistant'",
    ),
    "empty_content": (
        body(messages=[{"role": "user", "content": ""}]),
        "messages[0].content",
        "non-empty content",
    ),
    "image_url": (
        body(
            messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]
        ),
        "messages[0].content[0].source.url",
        "http or https URL",
    ),
    "document": (
        body(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
        "messages[0].content[0]",
        "document input is not supported by this model",
    ),
    "redacted": (
        body(
            messages=[*USER, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]
        ),
        "messages[1].content[0].type",
        "redacted_thinking",
    ),
    "unanswered": (
        body(tools=[TOOL], messages=[*USER, USE, *USER]),
        "messages[1]",
        "without `tool_result` blocks",
    ),
    "orphan": (
        body(
            messages=[
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "x"}]}
            ]
        ),
        "messages[0]",
        "unexpected `tool_use_id`",
    ),
    "result_after_text": (
        body(
            tools=[TOOL],
            messages=[
                *USER,
                USE,
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "x"},
                        {"type": "tool_result", "tool_use_id": "t1", "content": "r"},
                    ],
                },
            ],
        ),
        "messages[2].content[1]",
        "must come before",
    ),
    "tool_use_input": (
        body(
            messages=[
                *USER,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}],
                },
            ]
        ),
        "messages[1].content[0].input",
        "valid dictionary",
    ),
    "server_tool": (
        body(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        "tools[0].type",
        "server tools",
    ),
    "input_schema": (body(tools=[{"name": "f"}]), "tools[0].input_schema", "Field required"),
    "tool_name": (body(tools=[{**TOOL, "name": "a b"}]), "tools[0].name", "does not match pattern"),
    "tool_choice_forced_thinking": (
        body(tools=[TOOL], tool_choice={"type": "any"}, thinking={"type": "enabled"}),
        "tool_choice",
        "Thinking mode",
    ),
    "tool_choice_name": (
        body(tools=[TOOL], tool_choice={"type": "tool", "name": "g"}),
        "tool_choice",
        "no function named 'g'",
    ),
    "budget_small": (
        body(thinking={"type": "enabled", "budget_tokens": 100}),
        "thinking.budget_tokens",
        ">= 1024",
    ),
    "budget_over_max": (
        body(max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 4000}),
        "thinking.budget_tokens",
        "less than",
    ),
    "thinking_type": (body(thinking={"type": "maybe"}), "thinking.type", "must be one of"),
    "stop_sequences": (body(stop_sequences="x"), "stop_sequences", "list of strings"),
    "output_config": (body(output_config={"task_budget": 1}), "output_config.task_budget", "Extra inputs"),
    "system_image": (body(system=[{"type": "image", "source": {}}]), "system[0]", "only allowed in"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_a_400_naming_the_field(name: str) -> None:
    assert_names_field(parse_messages_request, *BAD[name])
