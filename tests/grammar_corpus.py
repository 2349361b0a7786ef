"""A corpus of realistic JSON Schemas for the grammar backends' tests and bench/grammar.py.

``SCHEMAS``: (name, schema, rejected_by) entries; ``rejected_by`` maps a backend that cannot
enforce the schema to a keyword its GrammarError must name. Most strings and arrays are bounded
so that a small model sampling at temperature 1 can finish within about 200 tokens; a few are
left unbounded on purpose. ``UNSUPPORTED``: (schema, a fragment every backend's error must hold)
for schemas no backend may accept: invalid, or asking for something no backend enforces.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple


class CorpusSchema(NamedTuple):
    name: str
    schema: dict[str, Any]
    rejected_by: Mapping[str, str] = MappingProxyType({})  # backend -> keyword its error names


def _s(max_length: int, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, **extra}


def _s_fmt(fmt: str) -> dict[str, Any]:
    return {"type": "string", "format": fmt}


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    required = list(properties) if required is None else required
    return {"type": "object", "properties": properties, "required": required, **extra}


_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_NO_BOUNDS = {"outlines": "minimum"}  # outlines ignores number bounds

SCHEMAS: list[CorpusSchema] = [
    CorpusSchema(
        "weather_args",
        _obj({"location": _s(40), "unit": {"enum": ["celsius", "fahrenheit"]}}, additionalProperties=False),
    ),
    CorpusSchema(
        "person",
        _obj(
            {
                "name": _s(30),
                "age": {"type": "integer", "minimum": 0, "maximum": 130},
                "email": _s_fmt("email"),
            },
            ["name", "age"],
        ),
        _NO_BOUNDS,
    ),
    CorpusSchema(
        "product",
        _obj(
            {
                "id": {"type": "string", "format": "uuid"},
                "name": _s(40),
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
                "tags": {"type": "array", "items": _s(12), "maxItems": 3},
                "in_stock": _BOOL,
            }
        ),
        {"outlines": "exclusiveMinimum"},
    ),
    CorpusSchema(
        "address",
        _obj(
            {
                "street": _s(40),
                "city": _s(25, minLength=1),
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"const": "US"},
            }
        ),
    ),
    CorpusSchema(
        "event",
        _obj(
            {
                "title": _s(40),
                "date": _s_fmt("date"),
                "start": _s_fmt("time"),
                "attendees": {"type": "array", "items": _s_fmt("email"), "maxItems": 2},
            }
        ),
    ),
    CorpusSchema(
        "log_entry",
        _obj(
            {
                "timestamp": _s_fmt("date-time"),
                "level": {"type": "string", "enum": ["debug", "info", "warning", "error"]},
                "message": _s(60),
                "context": {"type": "object", "additionalProperties": _s(20)},
            },
            ["timestamp", "level", "message"],
        ),
    ),
    CorpusSchema(
        "order",
        _obj(
            {
                "customer": _obj({"name": _s(30), "id": {"type": "integer", "minimum": 1}}),
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": _obj(
                        {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 10},
                        }
                    ),
                },
                "total": _NUM,
            }
        ),
        _NO_BOUNDS,
    ),
    CorpusSchema(
        "tree",
        {
            "$defs": {
                "node": _obj(
                    {
                        "value": _INT,
                        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                    },
                    ["value"],
                )
            },
            "$ref": "#/$defs/node",
        },
        {"outlines": "$ref"},
    ),
    CorpusSchema(
        "linked_list",
        {
            "$defs": {
                "item": _obj(
                    {"value": _s(8), "next": {"anyOf": [{"$ref": "#/$defs/item"}, {"type": "null"}]}}
                )
            },
            "$ref": "#/$defs/item",
        },
        {"outlines": "$ref"},
    ),
    CorpusSchema(
        "search_query",
        _obj(
            {
                "query": _s(50, minLength=1),
                "filters": _obj(
                    {
                        "category": {"enum": ["books", "music", "film"]},
                        "max_price": {"type": "number", "minimum": 0},
                    },
                    [],
                ),
                "limit": {"type": "integer", "minimum": 1, "maximum": 50},
            },
            ["query"],
        ),
        _NO_BOUNDS,
    ),
    CorpusSchema(
        "calendar_list",
        {
            "type": "array",
            "items": _obj({"day": _s_fmt("date"), "busy": _BOOL}),
            "minItems": 1,
            "maxItems": 3,
        },
    ),
    CorpusSchema("sentiment", {"type": "string", "enum": ["positive", "negative", "neutral"]}),
    CorpusSchema("yes_no", _BOOL),
    CorpusSchema("rating", {"type": "integer", "minimum": 1, "maximum": 5}, _NO_BOUNDS),
    CorpusSchema(
        "shape",
        {
            "oneOf": [
                _obj({"kind": {"const": "circle"}, "radius": _NUM}, additionalProperties=False),
                _obj({"kind": {"const": "rect"}, "width": _NUM, "height": _NUM}, additionalProperties=False),
            ]
        },
    ),
    CorpusSchema(
        "contact",
        _obj(
            {
                "name": _s(30),
                "reach": {
                    "anyOf": [
                        _obj({"email": _s_fmt("email")}, additionalProperties=False),
                        _obj(
                            {"phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}},
                            additionalProperties=False,
                        ),
                    ]
                },
            }
        ),
    ),
    CorpusSchema(
        "nullable_fields",
        _obj(
            {
                "first": _s(20),
                "middle": {"type": ["string", "null"], "maxLength": 20},
                "nickname": {"anyOf": [_s(10), {"type": "null"}]},
            }
        ),
    ),
    CorpusSchema("coordinates", {"type": "array", "prefixItems": [_NUM, _NUM], "items": False}),
    CorpusSchema(
        "matrix",
        {
            "type": "array",
            "items": {"type": "array", "items": _INT, "minItems": 1, "maxItems": 3},
            "minItems": 1,
            "maxItems": 3,
        },
    ),
    CorpusSchema(
        "settings_all_optional",
        _obj(
            {"theme": {"enum": ["dark", "light"]}, "font_size": _INT, "beta": _BOOL},
            [],
            additionalProperties=False,
        ),
    ),
    CorpusSchema("ip_v4_record", _obj({"host": _s(20), "ip": _s_fmt("ipv4"), "port": _INT})),
    CorpusSchema("ip_v6_record", _obj({"ip": _s_fmt("ipv6")}), {"outlines": "format"}),
    CorpusSchema(
        "invoice_refs",
        {
            "$defs": {"money": _obj({"amount": _NUM, "currency": {"enum": ["EUR", "USD"]}})},
            **_obj({"subtotal": {"$ref": "#/$defs/money"}, "tax": {"$ref": "#/$defs/money"}}),
        },
    ),
    CorpusSchema(
        "legacy_definitions",
        {"definitions": {"flag": _BOOL}, **_obj({"a": {"$ref": "#/definitions/flag"}, "b": _s(5)})},
    ),
    CorpusSchema(
        "company",
        _obj(
            {
                "name": _s(30),
                "departments": {
                    "type": "array",
                    "maxItems": 2,
                    "items": _obj(
                        {
                            "name": _s(20),
                            "employees": {
                                "type": "array",
                                "maxItems": 2,
                                "items": _obj(
                                    {
                                        "name": _s(20),
                                        "skills": {"type": "array", "items": _s(10), "maxItems": 2},
                                    }
                                ),
                            },
                        }
                    ),
                },
            }
        ),
    ),
    CorpusSchema(
        "percent_exclusive",
        _obj({"percent": {"type": "integer", "exclusiveMinimum": -1, "exclusiveMaximum": 101}}),
        {"outlines": "exclusiveMinimum"},
    ),
    CorpusSchema(
        "pack_size",
        _obj({"quantity": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}}),
        {"outlines": "multipleOf"},
    ),
    CorpusSchema("summary_unbounded", _obj({"summary": {"type": "string"}})),
    CorpusSchema("numbers_unbounded", _obj({"values": {"type": "array", "items": _INT}})),
    CorpusSchema("free_object", {"type": "object"}),
    CorpusSchema(
        "counts_map",
        {"type": "object", "additionalProperties": _INT, "maxProperties": 3},
        {"outlines": "maxProperties"},
    ),
    CorpusSchema("version_const", _obj({"header": {"const": {"version": 1, "kind": "v1"}}, "body": _s(20)})),
    CorpusSchema("mixed_enum", _obj({"choice": {"enum": ["a", 1, None, True, [1, 2]]}})),
    CorpusSchema(
        "whole_tool_call",
        _obj(
            {
                "name": {"const": "get_weather"},
                "arguments": _obj({"city": _s(30), "days": {"type": "integer", "minimum": 1, "maximum": 7}}),
            },
            additionalProperties=False,
        ),
        _NO_BOUNDS,
    ),
    CorpusSchema(
        "uuid_list", _obj({"ids": {"type": "array", "items": _s_fmt("uuid"), "minItems": 1, "maxItems": 2}})
    ),
    CorpusSchema("short_text", _obj({"code": _s(6, minLength=2), "label": _s(12, minLength=1)})),
    CorpusSchema(
        "flags_and_null",
        _obj({"enabled": _BOOL, "nothing": {"type": "null"}, "maybe": {"type": ["boolean", "null"]}}),
    ),
    CorpusSchema(
        "temperature_range",
        _obj(
            {
                "low": {"type": "number", "minimum": -50.5, "maximum": 60.5},
                "high": {"type": "number", "maximum": 60.5},
            }
        ),
        _NO_BOUNDS,
    ),
    CorpusSchema(
        "slug_keys",
        {
            "type": "object",
            "propertyNames": {"pattern": "^[a-z]{1,8}$"},
            "additionalProperties": _INT,
            "maxProperties": 2,
        },
        {"outlines": "propertyNames"},
    ),
    CorpusSchema(
        "pydantic_model",
        {
            "title": "Pet",
            "description": "A pet, as pydantic writes it.",
            "$defs": {"Species": {"title": "Species", "enum": ["cat", "dog"], "type": "string"}},
            "type": "object",
            "properties": {
                "name": {"title": "Name", "type": "string", "maxLength": 20},
                "species": {"allOf": [{"$ref": "#/$defs/Species"}], "description": "which kind"},
                "age": {"title": "Age", "anyOf": [_INT, {"type": "null"}], "default": None},
            },
            "required": ["name", "species"],
        },
    ),
    CorpusSchema(
        "unicode_text",
        _obj({"greeting": _s(8, minLength=1), "lang": {"enum": ["日本語", "français", "русский"]}}),
    ),
]

UNSUPPORTED: list[tuple[object, str]] = [
    ([1, 2], "schema must be"),
    ({"type": "string", "maxLenght": 5}, "maxLenght"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "array", "items": _INT, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "items": _INT, "contains": {"const": 2}}, "contains"),
    ({"type": "object", "patternProperties": {"^x": _INT}}, "patternProperties"),
    (_obj({"a": _INT, "b": _INT}, [], dependentRequired={"a": ["b"]}), "dependentRequired"),
    ({"type": "integer", "not": {"const": 3}}, "not"),
    (_obj({"a": _INT}, [], **{"if": {"required": ["a"]}, "then": {"required": ["a"]}}), "if"),
    (_obj({"a": _INT}, unevaluatedProperties=False), "unevaluatedProperties"),
    ({"type": "string", "minLength": -1}, "minLength"),
    ({"type": "array", "items": _INT, "minItems": 3, "maxItems": 2}, "minItems"),
    (_obj({"a": {"$ref": "#/$defs/missing"}}), "$ref"),
    ({"type": "string", "format": "credit-card"}, "format"),
    ({"type": "string", "pattern": "^[a-z$"}, "pattern"),
    ({"type": "string", "pattern": '^say "hi"$'}, "pattern"),
    ({"type": "string", "pattern": "^(?=a)a$"}, "pattern"),
    ({"allOf": [{"type": "integer"}, {"type": "number"}]}, "allOf"),
    ({"$defs": {"a": _INT}, "$ref": "#/$defs/a", "maximum": 3}, "maximum"),
    ({"type": "object", "anyOf": [_obj({"a": _INT}), _obj({"b": _INT})]}, "type"),
    (_obj({"a": _INT}, ["a", "b"]), "required"),
    ({"oneOf": [_INT, _NUM]}, "oneOf"),
    ({"type": "string", "minimum": 1}, "minimum"),
    ({"minLength": 3}, "minLength"),
    ({"enum": []}, "enum"),
    ({"type": "float"}, "type"),
    ({"type": "array", "items": [_INT, _INT]}, "items"),
    ({"type": "string", "format": "date", "maxLength": 20}, "maxLength"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 5}, "maxLength"),
    ({"type": "string", "enum": ["a", 1]}, "enum"),
    (_obj({"a": False}), "false"),
    ({"type": "integer", "minimum": 1.5}, "minimum"),
]
