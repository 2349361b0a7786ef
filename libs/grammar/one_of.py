"""Decides whether the branches of a ``oneOf`` are provably disjoint.

Both backends enforce ``oneOf`` as ``anyOf``: they accept text that matches two branches, which
``oneOf`` forbids. So a ``oneOf`` is accepted only when no value can match two of its branches,
shown cheaply: the branches differ in JSON type, in their const/enum values, or in the
const/enum values of a property both require (a discriminated union, the common case).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

Resolve = Callable[[str], object]  # a local $ref -> the subschema it names; LookupError if none

_MAX_HOPS: Final = 16  # $ref / single-allOf indirections followed to reach a branch's shape


@dataclass(frozen=True, slots=True)
class _Shape:
    types: frozenset[str] | None  # JSON types the branch can match; None: any
    values: frozenset[str] | None  # canonical JSON of the only values it matches; None: any
    tags: dict[str, frozenset[str]]  # required property -> canonical values it may take


def overlapping_branches(branches: list[Any], resolve: Resolve) -> tuple[int, int] | None:
    """The first pair of branch indices that may match the same value, or None."""
    shapes = [_shape(branch, resolve) for branch in branches]
    for i, j in itertools.combinations(range(len(shapes)), 2):
        if not _disjoint(shapes[i], shapes[j]):
            return i, j
    return None


def canonical(value: object) -> str:
    """JSON text that is equal for values JSON Schema calls equal (1 == 1.0, key order)."""
    return json.dumps(_whole_floats_as_ints(value), sort_keys=True)


def _whole_floats_as_ints(value: object) -> object:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_whole_floats_as_ints(item) for item in value]
    if isinstance(value, dict):
        return {key: _whole_floats_as_ints(item) for key, item in value.items()}
    return value


def _deref(node: object, resolve: Resolve) -> object:
    for _ in range(_MAX_HOPS):
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            try:
                node = resolve(node["$ref"])
            except LookupError:
                return True
        elif isinstance(node, dict) and isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1:
            node = node["allOf"][0]
        else:
            return node
    return True


def _values(node: dict[str, Any]) -> frozenset[str] | None:
    if "const" in node:
        return frozenset({canonical(node["const"])})
    if isinstance(node.get("enum"), list):
        return frozenset(canonical(value) for value in node["enum"])
    return None


def _types(node: dict[str, Any], values: frozenset[str] | None) -> frozenset[str] | None:
    declared = node.get("type")
    if isinstance(declared, str):
        names = {declared}
    elif isinstance(declared, list):
        names = {name for name in declared if isinstance(name, str)}
    elif values is not None:
        names = {_type_of(json.loads(value)) for value in values}
    elif "properties" in node:
        names = {"object"}
    else:
        return None
    if names & {"integer", "number"}:
        names |= {"integer", "number"}  # 1 is both
    return frozenset(names)


def _type_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "number", float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def _shape(branch: object, resolve: Resolve) -> _Shape:
    node = _deref(branch, resolve)
    if not isinstance(node, dict):
        return _Shape(None, None, {})
    values = _values(node)
    tags: dict[str, frozenset[str]] = {}
    properties = node.get("properties")
    required = node.get("required")
    if isinstance(properties, dict) and isinstance(required, list):
        for name in filter(lambda name: isinstance(name, str), required):
            prop = _deref(properties.get(name), resolve)
            prop_values = _values(prop) if isinstance(prop, dict) else None
            if prop_values is not None:
                tags[name] = prop_values
    return _Shape(_types(node, values), values, tags)


def _disjoint(a: _Shape, b: _Shape) -> bool:
    if a.types is not None and b.types is not None and not a.types & b.types:
        return True
    if a.values is not None and b.values is not None and not a.values & b.values:
        return True
    return any(not a.tags[name] & b.tags[name] for name in a.tags.keys() & b.tags.keys())
