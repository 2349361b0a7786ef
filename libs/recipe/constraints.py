"""The output constraint a conversation asks for, as the worker enforces it. Pure.

Response formats (``json_object``, ``json_schema``, ``regex``) constrain the answer; a forced tool
call (``tool_choice`` required or named, Anthropic's any/tool) constrains the call's JSON body to
the tools' names and argument schemas; strict tools under ``auto`` let the model write freely
but make any call it starts follow its tool's schema; a response format beside tools under
``auto`` makes the output one or the other: a call (its arguments per its schema when strict, a
JSON object otherwise), or the answer in the format. Which grammar backend enforces it, and
whether the schema is within what that backend honours, is checked by the gateway afterwards.

The call syntax is the chat format's: hermes-style ``<tool_call>{"name": ..., "arguments": ...}
</tool_call>`` bodies are JSON and constrained here; DeepSeek's DSML calls are XML-like markup
around the DSML special token, with per-parameter value types, and become a STRUCTURE
(dsml_constraints.py) that names that token by id.

With a reasoning model the constraint starts after the reasoning: ``start_after`` carries the
tokens that end it, and the worker lets the model think freely until it has written them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from libs.protocol.codec import pack_tokens
from libs.protocol.messages import StructuredOutput, StructuredOutputKind
from libs.recipe.conversation import Conversation, ToolDefinition
from libs.recipe.dsml_constraints import DsmlGrammar
from libs.recipe.output_parser import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from libs.recipe.template_format import Prompt

_ANY_OBJECT: dict[str, Any] = {"type": "object"}

_NO_MARKUP: Mapping[str, int] = MappingProxyType({})


def structured_output(
    conv: Conversation,
    prompt: Prompt,
    *,
    backend: str,
    reasoning_end: Sequence[int],
    markup_ids: Mapping[str, int] = _NO_MARKUP,
) -> StructuredOutput | None:
    """The constraint for ``conv`` rendered as ``prompt``, or None when the output is free.

    ``reasoning_end``: the token ids that close the model's reasoning (used when the prompt
    leaves the model reasoning). ``markup_ids``: the special tokens of call markup, by spelling
    (DSML's). Raises RecipeError for combinations no grammar can express.
    """
    start_after = pack_tokens(list(reasoning_end)) if prompt.start == "reasoning" else b""
    tools = conv.tools if conv.tool_choice != "none" else ()
    if tools and prompt.dsml is not None:
        return _dsml(conv, tools, DsmlGrammar(prompt.dsml, markup_ids), backend, start_after)
    if tools and conv.response_format != "text":
        if conv.tool_choice == "required":
            return _forced_call(tools, backend, start_after)
        return _call_or_format(conv, tools, backend, start_after)
    if tools and conv.tool_choice == "required":
        return _forced_call(tools, backend, start_after)
    if tools and any(t.strict for t in tools):
        return _strict_tools(tools, backend, start_after)
    if conv.response_format == "json_object":
        return StructuredOutput(StructuredOutputKind.JSON, backend=backend, start_after=start_after)
    if conv.response_format == "json_schema":
        spec = _canonical(conv.response_schema)
        return StructuredOutput(StructuredOutputKind.JSON_SCHEMA, spec, backend, start_after=start_after)
    if conv.response_format == "regex" and conv.response_regex:
        return StructuredOutput(
            StructuredOutputKind.REGEX, conv.response_regex, backend, start_after=start_after
        )
    return None


def _dsml(
    conv: Conversation,
    tools: Sequence[ToolDefinition],
    grammar: DsmlGrammar,
    backend: str,
    start_after: bytes,
) -> StructuredOutput | None:
    """The hermes cases below, for DSML calls: forced, call or format, strict tools; else free."""
    if conv.tool_choice == "required":
        tree = grammar.forced(tools)
    elif conv.response_format != "text":
        tree = grammar.call_or_format(tools, _format_node(conv))
    elif any(t.strict for t in tools):
        tree = grammar.triggered(tools)
    else:
        return None
    kind = StructuredOutputKind.STRUCTURE
    return StructuredOutput(kind, _canonical(tree), backend, start_after=start_after)


def _format_node(conv: Conversation) -> dict[str, Any]:
    """The response format as a structure node (its JSON schema, or its regex)."""
    fmt = _format(conv)
    return {"json": fmt["schema"]} if "schema" in fmt else fmt


def _format(conv: Conversation) -> dict[str, Any]:
    """The response format beside tools: ``{"regex": ...}`` or ``{"schema": ...}``."""
    if conv.response_format == "regex":
        return {"regex": conv.response_regex}
    if conv.response_format == "json_schema":
        return {"schema": conv.response_schema}
    return {"schema": _ANY_OBJECT}


def _call_schema(tool: ToolDefinition) -> dict[str, Any]:
    """The JSON body of one hermes call: its name, then arguments following the tool's schema."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters or _ANY_OBJECT},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _forced_call(tools: Sequence[ToolDefinition], backend: str, start_after: bytes) -> StructuredOutput:
    # The prompt already ends with the opening tag (template_format._encode): the output starts
    # at the JSON body and must close the call; EOS follows.
    calls = [_call_schema(t) for t in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return StructuredOutput(
        StructuredOutputKind.JSON_SCHEMA,
        _canonical(schema),
        backend,
        suffix="\n" + TOOL_CALL_CLOSE,
        start_after=start_after,
    )


def _strict_tools(tools: Sequence[ToolDefinition], backend: str, start_after: bytes) -> StructuredOutput:
    """Free text, but a call the model opens must name a declared tool and follow its schema
    (a non-strict tool's arguments only have to be a JSON object)."""
    spec = _canonical({"triggers": [TOOL_CALL_OPEN], "tags": _call_tags(tools)})
    return StructuredOutput(StructuredOutputKind.TOOL_TRIGGERS, spec, backend, start_after=start_after)


def _call_or_format(
    conv: Conversation, tools: Sequence[ToolDefinition], backend: str, start_after: bytes
) -> StructuredOutput:
    """Tools under auto beside a response format: the output is a call or the formatted answer."""
    spec = _canonical({"format": _format(conv), "tags": _call_tags(tools)})
    return StructuredOutput(StructuredOutputKind.CALL_OR_FORMAT, spec, backend, start_after=start_after)


def _call_tags(tools: Sequence[ToolDefinition]) -> list[dict[str, Any]]:
    """One hermes call per tool: its opening up to the arguments, their schema (a strict tool's
    own; any JSON object otherwise), its closing."""
    return [
        {
            "begin": f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(t.name)}, "arguments": ',
            "schema": (t.parameters or _ANY_OBJECT) if t.strict else _ANY_OBJECT,
            "end": "}\n" + TOOL_CALL_CLOSE,
        }
        for t in tools
    ]


def _canonical(value: Any) -> str:
    """One spelling per schema (so equal schemas share a compiled grammar); key order is kept,
    since it is the order the output writes properties in."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
