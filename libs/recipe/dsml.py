"""DeepSeek V4 / V4.1 prompt pieces in DSML markup: tool calls, the tools section, the response format.

Everything here returns ``Piece`` lists, (text, is_special) pairs: ``is_special`` marks a spelling the
encoder must emit as one special token. Only this module's own template constants are ever split
into special pieces; caller text (names, descriptions, arguments, schemas) always stays plain, so it
cannot smuggle in a special token. JSON is written the way the deepseek-recipe 0.2.0 wheel writes it:
Python ``json.dumps`` separators and float spelling, with V4's different small-float spelling.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from libs.recipe.conversation import RecipeError, ToolCall, ToolDefinition

Piece = tuple[str, bool]  # (text, is_special_token)

DSML: Final = "｜DSML｜"
# The special tokens grammars reach only by id, never as text (libs.grammar.grammar_vocab): DSML
# markup is the token itself, also where a vocabulary flags it as ordinary (DeepSeek V4's does).
GRAMMAR_MARKUP: Final = (DSML,)
THINK_START: Final = "<think>"
THINK_END: Final = "</think>"


@dataclass(frozen=True, slots=True)
class Dialect:
    """What differs between the V4 and V4.1 DSML spellings."""

    calls: str  # tag name after ｜DSML｜ of the outer block
    invoke: str
    parameter: str
    empty_invoke_blank_line: bool  # V4.1 writes a blank line inside a parameterless invoke
    v4_floats: bool  # V4 spells 1e-05 as 0.00001 and 1e-06 as 1e-6


V4_DIALECT: Final = Dialect("tool_calls", "invoke", "parameter", False, True)
V41_DIALECT: Final = Dialect(" calls", " invoke", " parameter", True, False)

# The template constants below spell DSML as "{D}"; _template() turns them into pieces.
_TOOLS_HEAD: Final = (
    "\n\n## Tools\n\nYou have access to a set of tools to help answer the user's question. "
    'You can invoke tools by writing a "<{D}{calls}>" block like the following:\n\n'
    "<{D}{calls}>\n"
    '<{D}{invoke} name="$TOOL_NAME">\n'
    '<{D}{parameter} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}{parameter}>\n'
    "...\n"
    "</{D}{invoke}>\n"
    '<{D}{invoke} name="$TOOL_NAME2">\n'
    "...\n"
    "</{D}{invoke}>\n"
    "</{D}{calls}>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_TAIL: Final = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
_SCHEMA_FORMAT: Final = (
    "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)
_V4_JSON_OBJECT_FORMAT: Final = (
    "\n\nYou are a helpful assistant designed to output JSON.\n"
    "## Response Format:\n\nReply with JSON object ONLY."
)
_SPECIAL_IN_TEMPLATE: Final = re.compile(
    f"({re.escape(DSML)}|{re.escape(THINK_START)}|{re.escape(THINK_END)})"
)


def _template(text: str, dialect: Dialect) -> list[Piece]:
    """Split one of this module's constants at its special spellings (never call this on caller text)."""
    filled = text.format(D=DSML, calls=dialect.calls, invoke=dialect.invoke, parameter=dialect.parameter)
    return [
        (part, bool(_SPECIAL_IN_TEMPLATE.fullmatch(part)))
        for part in _SPECIAL_IN_TEMPLATE.split(filled)
        if part
    ]


# ---- JSON, as the wheel writes it --------------------------------------------------------------------


def format_float(value: float, v4_floats: bool) -> str:
    """Python's shortest round-trip spelling; V4 writes exponent -5 positionally and pads no exponent."""
    if not math.isfinite(value):
        raise RecipeError(f"JSON cannot represent the number {value!r}")
    text = repr(value)
    if not v4_floats or "e-" not in text:
        return text
    mantissa, exponent = text.split("e-")
    if int(exponent) == 5:
        sign, digits = ("-", mantissa[1:]) if mantissa.startswith("-") else ("", mantissa)
        return f"{sign}0.0000{digits.replace('.', '')}"
    return f"{mantissa}e-{int(exponent)}"


def dump_json(value: Any, v4_floats: bool) -> str:
    """JSON with ", " / ": " separators and raw non-ASCII (``json.dumps(..., ensure_ascii=False)``)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return format_float(value, v4_floats)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, Mapping):
        items = (
            f"{json.dumps(str(k), ensure_ascii=False)}: {dump_json(v, v4_floats)}" for k, v in value.items()
        )
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(dump_json(v, v4_floats) for v in value) + "]"
    raise RecipeError(f"not a JSON value: {type(value).__name__}")


def _parse_int(text: str) -> int | float:
    # The wheel's JSON numbers: "-0" is a float, and integers outside i64/u64 become floats.
    if text == "-0":
        return -0.0
    number = int(text)
    return number if -(2**63) <= number < 2**64 else _parse_float(text)


def _parse_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError("number out of range")
    return number


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return any("\ud800" <= ch <= "\udfff" for ch in value)
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


def parse_arguments(arguments: str) -> dict[str, Any] | None:
    """The call's arguments as a JSON object, or None when they are not strict JSON naming an object."""
    try:
        value = json.loads(
            arguments, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_reject_constant
        )
    except ValueError:
        return None
    if not isinstance(value, dict) or _has_lone_surrogate(value):
        return None
    return value


# ---- DSML ---------------------------------------------------------------------------------------------


def tag_pieces(open_or_close: str, name: str, attributes: str = "") -> list[Piece]:
    """One DSML tag: ``<`` or ``</``, the DSML special token, the tag name, its attributes, ``>``."""
    return [(open_or_close, False), (DSML, True), (f"{name}{attributes}>", False)]


def _parameter(name: str, value: Any, dialect: Dialect) -> list[Piece]:
    # Strings go in raw (no escaping at all); everything else as JSON.
    is_string = isinstance(value, str)
    text = value if is_string else dump_json(value, dialect.v4_floats)
    flag = "true" if is_string else "false"
    return [
        *tag_pieces("<", dialect.parameter, f' name="{name}" string="{flag}"'),
        (text, False),
        *tag_pieces("</", dialect.parameter),
    ]


def _invoke(call: ToolCall, dialect: Dialect) -> list[Piece]:
    arguments = parse_arguments(call.arguments)
    # Arguments that are not a JSON object are passed on as one raw string parameter.
    params = arguments if arguments is not None else {"arguments": call.arguments}
    pieces = [*tag_pieces("<", dialect.invoke, f' name="{call.name}"'), ("\n", False)]
    for key, value in params.items():
        pieces += [*_parameter(key, value, dialect), ("\n", False)]
    if not params and dialect.empty_invoke_blank_line:
        pieces.append(("\n", False))
    return [*pieces, *tag_pieces("</", dialect.invoke)]


def tool_calls_block(calls: Sequence[ToolCall], dialect: Dialect) -> list[Piece]:
    """The DSML block of an assistant turn's calls, without the blank line that precedes it."""
    pieces = [*tag_pieces("<", dialect.calls), ("\n", False)]
    for call in calls:
        pieces += [*_invoke(call, dialect), ("\n", False)]
    return [*pieces, *tag_pieces("</", dialect.calls)]


def tool_calls_prefill(dialect: Dialect) -> list[Piece]:
    """What a forced tool call (tool_choice required) appends after the generation header."""
    return [("\n\n", False), *tag_pieces("<", dialect.calls), ("\n", False)]


def tools_section(tools: Sequence[ToolDefinition], dialect: Dialect) -> list[Piece]:
    """The ``## Tools`` section: instructions, then one JSON line per tool (caller text stays plain).

    A tool without parameters shows ``{}``, as the wheel's request conversion makes it."""
    lines = "\n".join(
        dump_json(
            {
                "name": tool.name,
                "description": tool.description or "",
                "parameters": {} if tool.parameters is None else tool.parameters,
            },
            dialect.v4_floats,
        )
        for tool in tools
    )
    return [*_template(_TOOLS_HEAD, dialect), (lines, False), (_TOOLS_TAIL, False)]


def response_format_section(kind: str, schema: Any, dialect: Dialect) -> str:
    """The ``## Response Format`` section (plain text); empty for text and regex formats."""
    if kind == "json_object":
        if dialect.v4_floats:
            return _V4_JSON_OBJECT_FORMAT
        return _SCHEMA_FORMAT + dump_json({"type": "json_object"}, False)
    if kind == "json_schema":
        if schema is None:
            raise RecipeError("response format json_schema needs a schema", param="response_format")
        return _SCHEMA_FORMAT + dump_json(schema, dialect.v4_floats)
    return ""
