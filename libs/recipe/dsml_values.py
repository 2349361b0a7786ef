"""Which forms a DSML parameter's value takes for its JSON Schema. Pure.

The renderer (dsml.py) writes a string as raw text (``string="true"``) and anything else as JSON
(``string="false"``), so a parameter's schema says which of the two the grammar allows: the raw
form when some value it admits is a string (with the string schema that value follows), the JSON
form unless every value it admits is a string. Local ``$ref`` chains are followed and ``anyOf`` /
``oneOf`` / ``allOf`` looked into; a schema that says nothing of its type admits both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

# Keywords that only a non-string value can satisfy: an untyped schema with one is not a string.
_NON_STRING_KEYWORDS: Final = frozenset(
    {
        "properties", "required", "additionalProperties", "patternProperties", "minProperties",
        "maxProperties", "items", "prefixItems", "minItems", "maxItems", "contains", "minimum",
        "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    }
)  # fmt: skip
_STRING_KEYWORDS: Final = ("pattern", "format", "minLength", "maxLength")
_MAX_REFS: Final = 32  # a $ref chain longer than this (or a cycle) is taken as admitting anything
_ANY_STRING: Final = {"type": "string"}


def raw_string_schema(schema: Any, defs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The string schema a raw (``string="true"``) value follows, or None when no string fits.
    Several string branches give any string (the union of their constraints is not one schema)."""
    schema = resolved(schema, defs)
    if schema is True or schema == {}:
        return dict(_ANY_STRING)
    if not isinstance(schema, dict):
        return None
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            found = [raw_string_schema(branch, defs) for branch in schema[key]]
            forms = [form for form in found if form is not None]
            return None if not forms else forms[0] if len(forms) == 1 else dict(_ANY_STRING)
    if isinstance(schema.get("allOf"), list):
        parts = [raw_string_schema(branch, defs) for branch in schema["allOf"]]
        return None if None in parts else dict(_ANY_STRING)
    listed = _listed(schema)
    if listed is not None:
        strings = [value for value in listed if isinstance(value, str)]
        return {"type": "string", "enum": strings} if strings else None
    kind = schema.get("type")
    strings_only = kind == "string" or (isinstance(kind, list) and "string" in kind)
    untyped = kind is None and not _NON_STRING_KEYWORDS & schema.keys()
    if strings_only or untyped:
        return {"type": "string", **{key: schema[key] for key in _STRING_KEYWORDS if key in schema}}
    return None


def admits_only_strings(schema: Any, defs: Mapping[str, Any]) -> bool:
    """Whether every value the schema admits is a string (then no JSON form)."""
    schema = resolved(schema, defs)
    if not isinstance(schema, dict):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return all(admits_only_strings(branch, defs) for branch in schema[key])
    if isinstance(schema.get("allOf"), list) and any(admits_only_strings(b, defs) for b in schema["allOf"]):
        return True
    listed = _listed(schema)
    if listed is not None:
        return all(isinstance(value, str) for value in listed)
    return schema.get("type") == "string"


def resolved(schema: Any, defs: Mapping[str, Any]) -> Any:
    """A local ``$ref`` (``#/$defs/X`` or ``#/definitions/X``) followed to its end; ``{}`` (any
    value) for a chain that does not end; the schema itself for anything else."""
    for _ in range(_MAX_REFS):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str):
            return schema
        target = None
        for key in ("$defs", "definitions"):
            prefix = f"#/{key}/"
            if ref.startswith(prefix) and isinstance(defs.get(key), dict):
                target = defs[key].get(ref[len(prefix) :])
        if target is None:
            return schema  # not a local definition: the JSON form's schema check answers for it
        schema = target
    return {}


def _listed(schema: dict[str, Any]) -> list[Any] | None:
    if "const" in schema:
        return [schema["const"]]
    enum = schema.get("enum")
    return enum if isinstance(enum, list) else None
