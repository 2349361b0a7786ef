"""Checks a JSON Schema against what a grammar backend really enforces, before anything compiles.

Every keyword accepted here is enforced token by token by the named backend. The tables were
established by experiment: for each keyword we tried to make the backend's matcher accept text
that violates it (tests/unit/grammar/test_keyword_tables.py replays those probes). Anything else
is a GrammarError naming it, with ``param`` the JSON path of the offending keyword: an unknown
keyword, one the backend ignores, an invalid value, or a combination a backend silently drops
(both libraries read only one of ``pattern`` / ``maxLength``, ignore what sits beside ``$ref``,
and enforce ``oneOf`` as ``anyOf``). Pure: no backend import, so the gateway runs it per request.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator, Mapping
from typing import Any, Final

from libs.grammar.backend import GrammarError
from libs.grammar.one_of import overlapping_branches
from libs.grammar.pattern_check import pattern_problem


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


ANNOTATIONS: Final = _words(
    "$schema $id $comment title description examples default deprecated readOnly writeOnly"
)
_OBJECT: Final = _words(
    "properties required additionalProperties minProperties maxProperties propertyNames"
    " patternProperties dependentRequired dependentSchemas unevaluatedProperties"
)
_ARRAY: Final = _words(
    "items prefixItems minItems maxItems uniqueItems contains minContains maxContains"
    " unevaluatedItems additionalItems"
)
_STRING: Final = _words("minLength maxLength pattern format contentEncoding contentMediaType contentSchema")
_NUMBER: Final = _words("minimum maximum exclusiveMinimum exclusiveMaximum multipleOf")
# The JSON type each type-specific keyword constrains ("number" keywords also apply to "integer").
TYPE_KEYWORDS: Final[Mapping[str, str]] = {
    **dict.fromkeys(_OBJECT, "object"),
    **dict.fromkeys(_ARRAY, "array"),
    **dict.fromkeys(_STRING, "string"),
    **dict.fromkeys(_NUMBER, "number"),
}
KNOWN: Final = (
    ANNOTATIONS
    | TYPE_KEYWORDS.keys()
    | _words(
        "type enum const anyOf oneOf allOf $ref $defs definitions not if then else dependencies"
        " $anchor $dynamicRef $dynamicAnchor $vocabulary"
    )
)
# The keywords each backend enforces (established by experiment: see the module docstring).
HONOURED: Final[Mapping[str, frozenset[str]]] = {
    "xgrammar": _words(
        "type enum const anyOf oneOf allOf $ref $defs definitions"
        " properties required additionalProperties minProperties maxProperties propertyNames"
        " items prefixItems minItems maxItems minLength maxLength pattern format"
        " minimum maximum exclusiveMinimum exclusiveMaximum multipleOf"
    ),
    "outlines": _words(
        "type enum const anyOf oneOf allOf $ref $defs definitions"
        " properties required additionalProperties"
        " items prefixItems minItems maxItems minLength maxLength pattern format"
    ),
}
_YEAR: Final = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR: Final = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE: Final = (
    f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)"
)
_TIME: Final = (
    "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
)
_OCTET: Final = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
# format -> the pattern that enforces it on every backend. Both libraries' own grammars for these
# let invalid values through (Feb 31, a missing UTC offset, leading zeros, raw '"' in an email).
FORMAT_PATTERNS: Final[Mapping[str, str]] = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "email": "[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\\.[A-Za-z0-9-]+)*\\.[A-Za-z]{2,}",
    "uuid": "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "ipv4": f"(?:{_OCTET}\\.){{3}}{_OCTET}",
}
FORMATS: Final[Mapping[str, frozenset[str]]] = {
    "xgrammar": frozenset(FORMAT_PATTERNS) | {"ipv6"},  # ipv6: xgrammar's own grammar holds
    "outlines": frozenset(FORMAT_PATTERNS),
}
TYPES: Final = frozenset({"string", "number", "integer", "boolean", "null", "array", "object"})
SCHEMA_KEYWORDS: Final = frozenset({"items", "additionalProperties", "propertyNames"})
SCHEMA_LIST_KEYWORDS: Final = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
SCHEMA_MAP_KEYWORDS: Final = frozenset({"properties", "$defs", "definitions"})
_COUNTS: Final = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_STRINGS: Final = frozenset({"string"})
_RANGES: Final = (
    ("minLength", "maxLength"),
    ("minItems", "maxItems"),
    ("minProperties", "maxProperties"),
    ("minimum", "maximum"),
)
_STANDALONE: Final = ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")  # siblings are ignored
_CONTAINERS: Final = ANNOTATIONS | {"$defs", "definitions"}
OUTLINES_MAX_REF_DEPTH: Final = 8  # outlines inlines $refs, nested at most this deep
XGRAMMAR_MULTIPLE_OF_SPAN: Final = 10000  # bounds this far apart make xgrammar drop multipleOf


def check_schema(schema: object, backend: str) -> None:
    """Raise GrammarError unless ``backend`` enforces every constraint of ``schema``."""
    if backend not in HONOURED:
        raise GrammarError(f"unknown grammar backend {backend!r}", param="backend")
    if schema is False:
        raise GrammarError("schema false accepts nothing")
    if not isinstance(schema, dict | bool):
        raise GrammarError("schema must be a JSON object or a boolean")
    checker = _Checker(schema, backend)
    checker.check(schema, "")
    if backend == "outlines":
        checker.ref_depth(schema, "", frozenset())


def subschemas(node: dict[str, Any], path: str, with_defs: bool = True) -> Iterator[tuple[Any, str]]:
    """(subschema, its path) for every subschema position of the keywords we accept."""
    for key, value in node.items():
        if key in SCHEMA_KEYWORDS and (isinstance(value, dict) or value is True):
            yield value, join(path, key)
        elif key in SCHEMA_LIST_KEYWORDS and isinstance(value, list):
            for i, item in enumerate(value):
                yield item, f"{join(path, key)}[{i}]"
        elif key in SCHEMA_MAP_KEYWORDS and isinstance(value, dict) and (with_defs or key == "properties"):
            for name, item in value.items():
                yield item, join(join(path, key), name)


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def resolve_ref(root: object, ref: str) -> object:
    """The subschema a local ``$ref`` names (``#``, ``#/$defs/x``, JSON-pointer escapes)."""
    if not ref.startswith("#"):
        raise LookupError("only local references ('#/...') are supported")
    node = root
    for part in filter(None, ref[1:].split("/")):
        key = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            raise LookupError("does not resolve inside the schema")
    return node


def _keyword_error(key: str, path: str, problem: str) -> GrammarError:
    where = f" at {path}" if path else ""
    return GrammarError(f"schema keyword {key!r}{where} {problem}", param=join(path, key))


def _declared_types(node: dict[str, Any]) -> frozenset[str]:
    declared = node.get("type")
    if isinstance(declared, str):
        return frozenset({declared})
    if isinstance(declared, list):
        return frozenset(declared)
    return frozenset({"object"}) if "properties" in node else frozenset()


def _bounds_keep_multiple_of(node: dict[str, Any]) -> bool:
    """xgrammar drops multipleOf beside a one-sided bound, or bounds 10000 or more apart."""
    lows = [node[key] for key in ("minimum", "exclusiveMinimum") if key in node]
    highs = [node[key] for key in ("maximum", "exclusiveMaximum") if key in node]
    if not lows and not highs:
        return True
    return bool(lows and highs) and max(highs) - min(lows) < XGRAMMAR_MULTIPLE_OF_SPAN


def _object_keys(value: object) -> Iterator[str]:
    """Every object key inside a JSON value (outlines writes const / enum keys unescaped)."""
    if isinstance(value, dict):
        yield from value
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            yield from _object_keys(item)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


class _Checker:
    def __init__(self, root: dict[str, Any] | bool, backend: str) -> None:
        self.root = root
        self.backend = backend
        self._depths: dict[str, int] = {}

    def check(self, node: object, path: str, implied: frozenset[str] = frozenset()) -> None:
        """``implied``: the JSON types the position allows anyway (property names are strings)."""
        if node is True:
            return
        if node is False:
            raise GrammarError(f"schema false at {path} accepts nothing", param=path)
        if not isinstance(node, dict):
            raise GrammarError(f"schema at {path} must be a JSON object or a boolean", param=path)
        for key, value in node.items():
            self._check_keyword(key, value, path)
        self._check_standalone(node, path)
        self._check_types(node, path, implied)
        self._check_combinations(node, path)
        for sub, sub_path in subschemas(node, path):
            self.check(sub, sub_path, _STRINGS if sub_path == join(path, "propertyNames") else frozenset())

    def _check_keyword(self, key: str, value: Any, path: str) -> None:
        if key not in KNOWN:
            raise _keyword_error(key, path, "is unknown")
        if key in ANNOTATIONS:
            return
        if key not in HONOURED[self.backend]:
            raise _keyword_error(key, path, f"is not supported by the {self.backend} backend")
        problem = self._value_problem(key, value)
        if problem:
            raise _keyword_error(key, path, problem)

    def _value_problem(self, key: str, value: Any) -> str | None:
        if key == "type":
            names = [value] if isinstance(value, str) else value if isinstance(value, list) else [None]
            valid = all(isinstance(name, str) and name in TYPES for name in names)
            if not names or not valid or len(set(names)) < len(names):
                return "must be a type name or a non-empty list of distinct type names"
        elif key == "enum" and (not isinstance(value, list) or not value):
            return "must be a non-empty array"
        elif key in SCHEMA_LIST_KEYWORDS and (not isinstance(value, list) or not value):
            return "must be a non-empty array of schemas"
        elif key in SCHEMA_MAP_KEYWORDS and not isinstance(value, dict):
            return "must be an object of schemas"
        elif key == "items" and isinstance(value, list):
            return "must be a single schema (use prefixItems for tuples)"
        elif key in SCHEMA_KEYWORDS and not isinstance(value, dict | bool):
            return "must be a schema"
        elif key == "required":
            if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
                return "must be an array of property names"
        elif key in _COUNTS and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            return "must be a non-negative integer"
        elif key in _NUMBER and not _is_number(value):
            return "must be a number"
        elif key == "multipleOf" and value <= 0:
            return "must be greater than 0"
        elif key == "$ref":
            return self._ref_problem(value)
        elif key == "pattern":
            if not isinstance(value, str):
                return "must be a string"
            problem = pattern_problem(value, self.backend)
            return f"{value!r} {problem}" if problem else None
        elif key == "format" and (not isinstance(value, str) or value not in FORMATS[self.backend]):
            return f"value {value!r} is not supported by the {self.backend} backend"
        return None

    def _ref_problem(self, ref: object) -> str | None:
        if not isinstance(ref, str):
            return "must be a string"
        if self.backend == "outlines" and ("~" in ref or "%" in ref):
            return f"{ref!r} uses an escape ('~' or '%'), which the outlines backend cannot resolve"
        try:
            resolve_ref(self.root, ref)
        except LookupError as exc:
            return f"{ref!r} {exc}"
        return None

    def _check_types(self, node: dict[str, Any], path: str, implied: frozenset[str]) -> None:
        declared = _declared_types(node) or implied
        for key, needed in TYPE_KEYWORDS.items():
            if key not in node:
                continue
            if not declared:
                raise _keyword_error(key, path, f'needs "type": "{needed}" beside it')
            if needed not in declared and not (needed == "number" and "integer" in declared):
                raise _keyword_error(key, path, f"does not apply to type {'/'.join(sorted(declared))}")
        for key in ("enum", "const"):
            values = node.get(key, []) if key == "enum" else [node[key]] if key in node else []
            for value in values:
                kind = _json_type(value)
                if declared and kind not in declared and not (kind == "integer" and "number" in declared):
                    raise _keyword_error(key, path, f"value {value!r} is not of the declared type")

    def _check_standalone(self, node: dict[str, Any], path: str) -> None:
        """Both libraries read only the first of these they find, and nothing beside it."""
        for alone in [key for key in _STANDALONE if key in node][:1]:
            allowed = _CONTAINERS | {alone} | ({"type"} if alone in ("enum", "const") else set())
            for other in sorted(node.keys() - allowed):
                raise _keyword_error(other, path, f"cannot be combined with {alone!r} (it is ignored)")

    def _check_combinations(self, node: dict[str, Any], path: str) -> None:
        if len(node.get("allOf", [None])) != 1:
            raise _keyword_error("allOf", path, "must hold exactly one schema (several are not supported)")
        properties = node.get("properties", {})
        for name in node.get("required", []):
            if name not in properties:
                raise _keyword_error("required", path, f"names {name!r}, which is not in properties")
        for key in ("pattern", "format"):
            for other in ("minLength", "maxLength", "pattern"):
                if key in node and other in node and other != key:
                    raise _keyword_error(other, path, f"cannot be combined with {key!r} (it is ignored)")
        for low, high in _RANGES:
            if low in node and high in node and node[low] > node[high]:
                raise _keyword_error(low, path, f"is greater than {high}")
        if "oneOf" in node:
            overlap = overlapping_branches(node["oneOf"], lambda ref: resolve_ref(self.root, ref))
            if overlap:
                raise _keyword_error(
                    "oneOf",
                    path,
                    f"branches {overlap[0]} and {overlap[1]} may both match (the backends "
                    "enforce oneOf as anyOf): distinguish them by type or a required const property",
                )
        self._check_backend_rules(node, path)

    def _check_backend_rules(self, node: dict[str, Any], path: str) -> None:
        num_prefix = len(node.get("prefixItems", []))
        if self.backend == "xgrammar":
            if _declared_types(node) == {"integer"}:
                for key in _NUMBER:
                    if key in node and not float(node[key]).is_integer():
                        raise _keyword_error(key, path, "must be a whole number on an integer")
            if "multipleOf" in node and _declared_types(node) != {"integer"}:
                raise _keyword_error("multipleOf", path, 'is only supported with "type": "integer"')
            if "multipleOf" in node and not _bounds_keep_multiple_of(node):
                span = f"under {XGRAMMAR_MULTIPLE_OF_SPAN} apart"
                raise _keyword_error(
                    "multipleOf", path, f"needs a lower and an upper bound {span}, or neither"
                )
            if node.get("items", False) is False and node.get("minItems", 0) > num_prefix:
                raise _keyword_error("minItems", path, "needs 'items' (more items than prefixItems)")
            return
        if num_prefix and ("minItems" in node or "maxItems" in node):
            key = "minItems" if "minItems" in node else "maxItems"
            raise _keyword_error(key, path, "cannot be combined with prefixItems on the outlines backend")
        if node.get("items") is False and not num_prefix:
            raise _keyword_error("items", path, "false needs prefixItems on the outlines backend")
        if node.get("additionalProperties") is False and "properties" not in node:
            raise _keyword_error("additionalProperties", path, "false needs properties (outlines backend)")
        literals = [node["const"]] if "const" in node else node.get("enum", [])
        literal_key = "const" if "const" in node else "enum"
        for key, names in (("properties", node.get("properties", {})), (literal_key, _object_keys(literals))):
            for name in names:
                if any(ch in '"\\' or ord(ch) < 0x20 for ch in name):
                    raise _keyword_error(key, path, f"name {name!r} needs escapes (outlines backend)")

    def ref_depth(self, node: object, path: str, stack: frozenset[str]) -> int:
        """Deepest chain of nested $refs below ``node``; raises on recursion (outlines inlines refs)."""
        if not isinstance(node, dict):
            return 0
        depth = 0
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref in stack:
                raise _keyword_error("$ref", path, f"{ref!r} is recursive (not supported by outlines)")
            if ref not in self._depths:
                target_path = ".".join(filter(None, ref[1:].split("/")))
                self._depths[ref] = 1 + self.ref_depth(
                    resolve_ref(self.root, ref), target_path, stack | {ref}
                )
            depth = self._depths[ref]
            if depth > OUTLINES_MAX_REF_DEPTH:
                raise _keyword_error("$ref", path, f"nests over {OUTLINES_MAX_REF_DEPTH} references deep")
        for sub, sub_path in subschemas(node, path, with_defs=False):
            depth = max(depth, self.ref_depth(sub, sub_path, stack))
        return depth
