"""Tool definitions, tool_choice and strict JSON Schemas, shared by every API. Pure.

Each API spells a function tool its own way (Chat nests it under ``function``, Responses is flat,
Messages says ``input_schema``); the callers pick the fields out and this module validates and
normalises them into ``ToolDefinition``s, then resolves ``tool_choice`` against them.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from libs.recipe.conversation import ToolChoice, ToolDefinition
from libs.recipe.fields import ApiError, check_depth, optional_bool, optional_str, shown

NAME_PATTERN = "^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function (and json_schema) names
_NAME = re.compile(NAME_PATTERN)
# Keywords whose value is one subschema / a list of them / a map of them: strict normalisation
# walks all of these, so an object nested anywhere (array items, unions, $defs) is closed too.
_ONE = ("items", "not", "additionalItems", "contains")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties")
_OBJECT_ORDER = ("type", "properties", "additionalProperties", "required")


@dataclass(frozen=True, slots=True)
class ToolChoiceSpec:
    """A client's tool_choice, spelling removed: a mode, or one function by name."""

    mode: ToolChoice
    name: str | None = None  # set: "call exactly this function" (mode is then "required")
    param: str = "tool_choice"


def check_name(name: Any, param: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ApiError(
            400,
            f"Invalid '{param}': string does not match pattern. "
            f"Expected a string that matches the pattern '{NAME_PATTERN}'.",
            param=param,
        )
    return name


def _is_object_schema(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node


def _close_object(node: dict[str, Any], param: str, require_all: bool) -> None:
    extra = node.get("additionalProperties", False)
    if extra is not False:
        # Strict output can only honour a closed object; silently closing it would change the tool.
        raise ApiError(400, f"'{param}': additionalProperties must be false in strict mode", param=param)
    node["additionalProperties"] = False
    properties = node.setdefault("properties", {})
    if not isinstance(properties, dict):
        raise ApiError(400, f"'{param}': 'properties' must be an object", param=param)
    if require_all:
        node["required"] = list(properties)
    # The schema is rendered into the prompt: keys in the wheel's order, then the others as given.
    ordered = {key: node.pop(key) for key in _OBJECT_ORDER if key in node}
    rest = dict(node)
    node.clear()
    node.update(ordered)
    node.update(rest)


def _normalise(node: Any, param: str, require_all: bool) -> None:
    if not isinstance(node, dict):
        return  # booleans and malformed subschemas are the constraint engine's business
    if _is_object_schema(node):
        _close_object(node, param, require_all)
    for key in _ONE:
        _normalise(node.get(key), param, require_all)
    for key in _MANY:
        if isinstance(node.get(key), list):
            for sub in node[key]:
                _normalise(sub, param, require_all)
    for key in _MAP:
        if isinstance(node.get(key), dict):
            for sub in node[key].values():
                _normalise(sub, param, require_all)


def strict_schema(schema: Any, param: str, require_all: bool = True) -> dict[str, Any]:
    """A copy of ``schema`` normalised for strict mode, recursively: every object gets
    ``additionalProperties: false`` and (OpenAI's rule, ``require_all``) every property required.

    Anthropic's strict tools only close objects: their optional properties stay optional.
    An explicit ``additionalProperties`` other than false is a 400, not silently overridden.
    """
    check_depth(schema, param)  # deepcopy and _normalise recurse
    out: dict[str, Any] = {"type": "object"} if schema is None else copy.deepcopy(schema)
    if not isinstance(out, dict):
        raise ApiError(400, f"'{param}' must be a JSON Schema object", param=param)
    _normalise(out, param, require_all)
    return out


def tool_definition(
    spec: dict[str, Any], where: str, schema_key: str = "parameters", require_all: bool = True
) -> ToolDefinition:
    """Validate one function tool from ``spec``, the object holding its name, description, strict
    and parameters' schema (which the API calls ``schema_key``); ``where`` is that object's path."""
    name = check_name(spec.get("name"), f"{where}.name")
    description = optional_str(spec, "description", f"{where}.description")
    strict = optional_bool(spec, "strict", f"{where}.strict")
    parameters = spec.get(schema_key)
    param = f"{where}.{schema_key}"
    if parameters is not None:
        kind = parameters.get("type", "object") if isinstance(parameters, dict) else None
        if kind != "object":
            got = f"'type: {shown(kind)}'" if isinstance(parameters, dict) else shown(parameters)
            raise ApiError(
                400,
                f"Invalid schema for function '{name}': schema must be a JSON Schema of "
                f"'type: \"object\"', got {got}.",
                param=param,
            )
        check_depth(parameters, param)  # rendered into the prompt and compiled into constraints
    if strict:
        parameters = strict_schema(parameters, param, require_all)
    return ToolDefinition(name=name, description=description, parameters=parameters, strict=strict)


def unique_tools(tools: list[ToolDefinition], param: str = "tools") -> tuple[ToolDefinition, ...]:
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "Tool names must be unique.", param=param)
    return tuple(tools)


def parse_tools(
    body: dict[str, Any],
    tool: Callable[[Any, str], ToolDefinition],
    not_a_list: str = "'tools' must be an array",
) -> tuple[ToolDefinition, ...]:
    """``body["tools"]``, each item read by ``tool(item, "tools[i]")`` (one API's spelling of a
    tool), then checked for unique names. ``not_a_list`` words the error in the API's own voice."""
    raw = body.get("tools")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ApiError(400, not_a_list, param="tools")
    return unique_tools([tool(item, f"tools[{i}]") for i, item in enumerate(raw)])


def resolve_tool_choice(
    choice: ToolChoiceSpec, tools: tuple[ToolDefinition, ...], thinking: bool | None
) -> tuple[ToolChoice, tuple[ToolDefinition, ...]]:
    """The Conversation's (tool_choice, tools).

    A named tool becomes "required" with only that tool declared; "none" declares no tools (the
    model is told of none, and none are parsed). Forcing a call conflicts with thinking only when
    thinking is explicitly on: ``None`` (the model's default) leaves that decision to the format.
    """
    if choice.mode == "none":
        return "none", ()
    if choice.mode == "required" and not tools:
        raise ApiError(
            400,
            f"Invalid value for '{choice.param}': '{choice.param}' is only allowed when 'tools' are "
            "specified.",
            param=choice.param,
        )
    if choice.name is not None:
        tools = tuple(tool for tool in tools if tool.name == choice.name)
        if not tools:
            raise ApiError(
                400,
                f"Invalid value for '{choice.param}': no function named '{choice.name}' was specified "
                "in the 'tools' parameter.",
                param=choice.param,
            )
    if choice.mode == "required" and thinking is True:
        raise ApiError(400, "Thinking mode does not support this tool_choice", param=choice.param)
    return choice.mode, tools
