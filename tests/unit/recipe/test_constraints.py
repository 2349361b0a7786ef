"""The constraint a conversation asks for: formats, forced and strict tool calls, reasoning."""

from __future__ import annotations

import json

from libs.protocol.codec import unpack_tokens
from libs.protocol.messages import StructuredOutputKind
from libs.recipe.constraints import structured_output
from libs.recipe.conversation import Conversation, Message, ToolDefinition
from libs.recipe.dsml import V41_DIALECT
from libs.recipe.template_format import Prompt

ASK = (Message("user", "hi"),)
HERMES = Prompt([1, 2], syntax="hermes", start="content", parse_tool_calls=True, thinking=False)
FORCED = Prompt([1, 2], syntax="hermes", start="tool_calls", parse_tool_calls=True, thinking=False)
REASONING = Prompt([1, 2], syntax="deepseek", start="reasoning", parse_tool_calls=False, thinking=True)


def dsml_prompt(start: str, thinking: bool = False) -> Prompt:
    return Prompt([1], "deepseek", start, parse_tool_calls=True, thinking=thinking, dsml=V41_DIALECT)  # type: ignore[arg-type]


ARGS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = ToolDefinition("weather", parameters=ARGS)
CLOCK = ToolDefinition("clock")


def build(conv: Conversation, prompt: Prompt = HERMES) -> object:
    return structured_output(conv, prompt, backend="xgrammar", reasoning_end=[7])


def test_free_output_has_no_constraint() -> None:
    assert build(Conversation(ASK)) is None
    assert build(Conversation(ASK, tools=(WEATHER,))) is None  # auto, not strict: free


def test_response_formats() -> None:
    json_object = build(Conversation(ASK, response_format="json_object"))
    assert json_object is not None and json_object.kind is StructuredOutputKind.JSON
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    out = build(Conversation(ASK, response_format="json_schema", response_schema=schema))
    assert out is not None and out.kind is StructuredOutputKind.JSON_SCHEMA
    assert list(json.loads(out.spec)["properties"]) == ["b", "a"]  # the order the output writes
    assert out.backend == "xgrammar" and out.start_after == b""
    regex = build(Conversation(ASK, response_format="regex", response_regex="(yes|no)"))
    assert regex is not None and regex.kind is StructuredOutputKind.REGEX and regex.spec == "(yes|no)"


def test_a_forced_call_names_a_declared_tool_and_closes_the_tag() -> None:
    out = build(Conversation(ASK, tools=(WEATHER, CLOCK), tool_choice="required"), FORCED)
    assert out is not None and out.kind is StructuredOutputKind.JSON_SCHEMA
    assert out.prefix == "" and out.suffix == "\n</tool_call>"  # the prompt opened the tag
    calls = json.loads(out.spec)["anyOf"]
    assert [c["properties"]["name"] for c in calls] == [{"const": "weather"}, {"const": "clock"}]
    assert calls[0]["properties"]["arguments"] == ARGS
    assert calls[1]["properties"]["arguments"] == {"type": "object"}  # no parameters declared
    one = build(Conversation(ASK, tools=(WEATHER,), tool_choice="required"), FORCED)
    assert one is not None and json.loads(one.spec)["required"] == ["name", "arguments"]


def test_strict_tools_under_auto_trigger_on_the_call_tag() -> None:
    strict = ToolDefinition("weather", parameters=ARGS, strict=True)
    out = build(Conversation(ASK, tools=(strict, CLOCK)))
    assert out is not None and out.kind is StructuredOutputKind.TOOL_TRIGGERS
    spec = json.loads(out.spec)
    assert spec["triggers"] == ["<tool_call>"]
    assert [t["schema"] for t in spec["tags"]] == [ARGS, {"type": "object"}]  # non-strict: any object
    assert spec["tags"][0]["begin"] == '<tool_call>\n{"name": "weather", "arguments": '


def test_a_format_beside_auto_tools_is_a_call_or_the_format() -> None:
    strict = ToolDefinition("weather", parameters=ARGS, strict=True)
    conv = Conversation(ASK, tools=(strict, CLOCK), response_format="json_schema", response_schema=ARGS)
    out = build(conv)
    assert out is not None and out.kind is StructuredOutputKind.CALL_OR_FORMAT
    spec = json.loads(out.spec)
    assert spec["format"] == {"schema": ARGS}
    assert [t["schema"] for t in spec["tags"]] == [ARGS, {"type": "object"}]
    assert spec["tags"][1]["begin"] == '<tool_call>\n{"name": "clock", "arguments": '
    plain = build(Conversation(ASK, tools=(WEATHER,), response_format="json_object"))
    assert plain is not None and json.loads(plain.spec)["format"] == {"schema": {"type": "object"}}
    # DSML calls: the same union, as a structure (test_dsml_constraints.py walks it)
    dsml = dsml_prompt("content")
    union = build(Conversation(ASK, tools=(WEATHER,), response_format="json_object"), dsml)
    assert union is not None and union.kind is StructuredOutputKind.STRUCTURE
    assert json.loads(union.spec)["or"][0] == {"json": {"type": "object"}}
    forced = build(
        Conversation(ASK, tools=(WEATHER,), tool_choice="required", response_format="json_object"), FORCED
    )
    assert forced is not None and forced.suffix  # a forced call has no content to shape


def test_reasoning_delays_the_constraint_and_dsml_calls_are_structures() -> None:
    out = build(Conversation(ASK, response_format="json_object"), REASONING)
    assert out is not None and unpack_tokens(out.start_after) == [7]
    dsml = dsml_prompt("tool_calls")
    forced = build(Conversation(ASK, tools=(WEATHER,), tool_choice="required"), dsml)
    assert forced is not None and forced.kind is StructuredOutputKind.STRUCTURE
    assert build(Conversation(ASK, tools=(WEATHER,)), dsml) is None  # auto, not strict: free
    strict_tool = ToolDefinition("weather", parameters=ARGS, strict=True)
    strict = build(Conversation(ASK, tools=(strict_tool,)), dsml_prompt("reasoning", thinking=True))
    assert strict is not None and unpack_tokens(strict.start_after) == [7]
