"""Turns the spec of a StructuredOutput into checked parts a backend compiles as they are.

``load_schema`` parses a JSON Schema, checks it for the backend (``schema_check``), then rewrites
it into the subset both libraries enforce natively: a ``format`` becomes its pattern
(``FORMAT_PATTERNS``), patterns are spelled as ``pattern_check.backend_pattern`` says, object and
array ``const`` / ``enum`` values become schemas (the libraries would spell them in their own
whitespace style), ``true`` subschemas become ``{}`` and annotations are dropped (outlines can
read neither).
``load_tool_triggers`` does the same for the tags of a TOOL_TRIGGERS spec, and ``load_call_or_format``
for a CALL_OR_FORMAT spec (the format's schema or regex, and the tags); ``load_schema_value`` for a
schema inside a larger spec (structure.py). Pure: no backend import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from libs.grammar.backend import GrammarError
from libs.grammar.pattern_check import backend_pattern
from libs.grammar.schema_check import (
    ANNOTATIONS,
    FORMAT_PATTERNS,
    SCHEMA_KEYWORDS,
    SCHEMA_LIST_KEYWORDS,
    SCHEMA_MAP_KEYWORDS,
    check_schema,
)


@dataclass(frozen=True, slots=True)
class ToolTag:
    begin: str  # literal text that opens the call; starts with one of the triggers
    schema: object  # the call body's schema, rewritten for the backend
    end: str  # literal text that closes the call


@dataclass(frozen=True, slots=True)
class ToolTriggers:
    triggers: tuple[str, ...]
    tags: tuple[ToolTag, ...]


@dataclass(frozen=True, slots=True)
class CallOrFormat:
    """The whole output is the format (a schema, or a regex when ``regex`` is set) or one tag."""

    schema: object
    regex: str | None
    tags: tuple[ToolTag, ...]


def load_schema(spec: str, backend: str) -> object:
    """The schema in ``spec``, checked for ``backend`` and rewritten for it. Raises GrammarError."""
    return _checked(_parse(spec), backend)


def load_schema_value(schema: object, backend: str, where: str) -> object:
    """A schema given as a value (inside a larger spec), checked and rewritten; errors name ``where``."""
    try:
        return _checked(schema, backend)
    except GrammarError as exc:
        raise GrammarError(f"{where}: {exc}", param=where + (f".{exc.param}" if exc.param else "")) from None


def load_tool_triggers(spec: str, backend: str) -> ToolTriggers:
    """``{"triggers": [str], "tags": [{"begin": str, "schema": {...}, "end": str}]}``, checked."""
    data = _parse(spec)
    triggers = data.get("triggers") if isinstance(data, dict) else None
    tags = data.get("tags") if isinstance(data, dict) else None
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise GrammarError("tool triggers need a non-empty list of non-empty strings", param="triggers")
    if not isinstance(tags, list) or not tags:
        raise GrammarError("tool triggers need a non-empty list of tags", param="tags")
    return ToolTriggers(
        tuple(triggers), tuple(_load_tag(tag, i, triggers, backend) for i, tag in enumerate(tags))
    )


def load_call_or_format(spec: str, backend: str) -> CallOrFormat:
    """``{"format": {"schema": {...}} | {"regex": str}, "tags": [...]}``, checked."""
    data = _parse(spec)
    fmt = data.get("format") if isinstance(data, dict) else None
    tags = data.get("tags") if isinstance(data, dict) else None
    if not isinstance(tags, list) or not tags:
        raise GrammarError("a call-or-format constraint needs a non-empty list of tags", param="tags")
    loaded = tuple(_load_tag(tag, i, [""], backend) for i, tag in enumerate(tags))
    if isinstance(fmt, dict) and isinstance(fmt.get("regex"), str):
        return CallOrFormat({}, fmt["regex"], loaded)
    if isinstance(fmt, dict) and "schema" in fmt:
        try:
            return CallOrFormat(_checked(fmt["schema"], backend), None, loaded)
        except GrammarError as exc:
            raise GrammarError(f"format.schema: {exc}", param="response_format") from None
    raise GrammarError("a call-or-format constraint needs a format: a schema or a regex", param="format")


def _load_tag(tag: object, index: int, triggers: list[str], backend: str) -> ToolTag:
    where = f"tags[{index}]"
    if not isinstance(tag, dict) or not {"begin", "schema", "end"} <= tag.keys():
        raise GrammarError(f"{where} must be an object with begin, schema and end", param=where)
    begin, end = tag["begin"], tag["end"]
    if not isinstance(begin, str) or not any(begin.startswith(t) for t in triggers):
        raise GrammarError(f"{where}.begin must be a string starting with a trigger", param=f"{where}.begin")
    if not isinstance(end, str):
        raise GrammarError(f"{where}.end must be a string", param=f"{where}.end")
    try:
        schema = _checked(tag["schema"], backend)
    except GrammarError as exc:
        param = f"{where}.schema" + (f".{exc.param}" if exc.param else "")
        raise GrammarError(f"{where}.schema: {exc}", param=param) from None
    return ToolTag(begin, schema, end)


def _checked(schema: object, backend: str) -> object:
    try:
        check_schema(schema, backend)
        return rewrite_schema(schema, backend)
    except RecursionError:
        raise GrammarError("schema nests too deeply") from None


def rewrite_schema(schema: object, backend: str) -> object:
    """A checked schema rewritten as the module docstring says (paths that $refs name are kept)."""
    if schema is True and backend == "outlines":
        return {}
    if not isinstance(schema, dict):
        return schema
    values = [schema["const"]] if "const" in schema else schema.get("enum", [])
    if any(isinstance(value, dict | list) for value in values):
        literal = (
            _literal_schema(values[0])
            if "const" in schema
            else {"anyOf": [_literal_schema(v) for v in values]}
        )
        defs = {key: schema[key] for key in ("$defs", "definitions") if key in schema}
        return rewrite_schema({**literal, **defs}, backend)
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ANNOTATIONS:
            continue
        if key == "format" and value in FORMAT_PATTERNS:
            out["pattern"] = backend_pattern(FORMAT_PATTERNS[value])
        elif key == "pattern":
            out["pattern"] = backend_pattern(value)
        elif key in SCHEMA_KEYWORDS and not (key == "additionalProperties" and isinstance(value, bool)):
            out[key] = rewrite_schema(value, backend)  # (outlines reads additionalProperties: true)
        elif key in SCHEMA_LIST_KEYWORDS:
            out[key] = [rewrite_schema(item, backend) for item in value]
        elif key in SCHEMA_MAP_KEYWORDS:
            out[key] = {name: rewrite_schema(item, backend) for name, item in value.items()}
        else:
            out[key] = value
    return out


def _literal_schema(value: object) -> dict[str, Any]:
    """A schema matching exactly ``value``, spelled as the backend spells any other JSON."""
    if isinstance(value, dict):
        properties = {key: _literal_schema(item) for key, item in value.items()}
        return {
            "type": "object",
            "properties": properties,
            "required": list(value),
            "additionalProperties": False,
        }
    if isinstance(value, list) and value:
        items = [_literal_schema(item) for item in value]
        return {"type": "array", "prefixItems": items, "items": False, "minItems": len(value)}
    if isinstance(value, list):
        return {"type": "array", "maxItems": 0}
    return {"const": value}


def _parse(spec: str) -> Any:
    try:
        return json.loads(spec)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise GrammarError(f"spec is not valid JSON ({exc})") from None
