"""check_schema's verdicts and messages, pattern checks, oneOf disjointness, $ref rules, and the
rewrite a checked schema gets before a backend compiles it (pure: no backend involved)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from libs.grammar.backend import GrammarError
from libs.grammar.constraint import load_schema, load_tool_triggers
from libs.grammar.pattern_check import backend_pattern, pattern_problem
from libs.grammar.schema_check import (
    ANNOTATIONS,
    FORMAT_PATTERNS,
    HONOURED,
    KNOWN,
    OUTLINES_MAX_REF_DEPTH,
    check_schema,
)

BOTH = ("xgrammar", "outlines")
INT: dict[str, Any] = {"type": "integer"}
NUM: dict[str, Any] = {"type": "number"}


def refusal(schema: object, backend: str) -> GrammarError:
    with pytest.raises(GrammarError) as info:
        check_schema(schema, backend)
    return info.value


def test_tables_are_consistent() -> None:
    assert HONOURED["outlines"] <= HONOURED["xgrammar"] <= KNOWN
    for pattern in FORMAT_PATTERNS.values():
        assert pattern_problem(pattern, "outlines") is None


def test_message_and_param_name_the_keyword() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer", "multipleOf": 2}}}
    error = refusal(schema, "outlines")
    assert (
        str(error) == "schema keyword 'multipleOf' at properties.x is not supported by the outlines backend"
    )
    assert error.param == "properties.x.multipleOf"
    error = refusal({"anyOf": [INT, {"type": "string", "maxLenght": 3}]}, "xgrammar")
    assert error.param == "anyOf[1].maxLenght" and "unknown" in str(error)
    assert refusal({"type": "string"}, "llama").param == "backend"


@pytest.mark.parametrize("backend", BOTH)
def test_annotations_and_booleans(backend: str) -> None:
    annotated = {key: "x" for key in ANNOTATIONS} | {"type": "string"}
    check_schema(annotated, backend)
    check_schema(True, backend)
    check_schema({"type": "array", "prefixItems": [INT], "items": False}, backend)
    assert "accepts nothing" in str(refusal(False, backend))
    assert refusal({"properties": {"a": False}}, backend).param == "properties.a"


@pytest.mark.parametrize("backend", BOTH)
def test_type_specific_keywords_need_their_type(backend: str) -> None:
    assert 'needs "type": "string"' in str(refusal({"maxLength": 3}, backend))
    assert "does not apply to type integer" in str(refusal({"type": "integer", "maxItems": 3}, backend))
    check_schema({"properties": {"a": INT}, "required": ["a"]}, backend)  # object implied
    check_schema({"type": ["string", "null"], "maxLength": 3}, backend)
    assert refusal({"type": "string", "const": 3}, backend).param == "const"


@pytest.mark.parametrize(
    "pattern,xgrammar_ok,outlines_ok",
    [
        ("^[a-z]+$", True, True),
        ("\\d{3}-\\d{4}", True, True),
        ("^.{1,5}$", True, False),  # outlines would let '.' write a raw '"'
        ("[^a]+", True, False),
        ("a\\sb", True, False),
        ('["a]', True, False),
        ('a"b', False, False),  # a literal '"' goes through both unescaped
        ("a\\\\b", False, False),
        ("a\\nb", False, False),
        ("(?=a)a", False, False),
        ("^a|b$", False, False),
        ("(?i)a", False, False),
        ("(a)\\1", False, False),
        ("[a-", False, False),
    ],
)
def test_pattern_problems(pattern: str, xgrammar_ok: bool, outlines_ok: bool) -> None:
    assert (pattern_problem(pattern, "xgrammar") is None) == xgrammar_ok
    assert (pattern_problem(pattern, "outlines") is None) == outlines_ok


def test_backend_pattern() -> None:
    assert backend_pattern("^a(?:xb+)?$") == "^(?:a(?:xb+){0,1})$"
    assert backend_pattern("a(b)??c") == "^(?:a(b){0,1}c)$"
    assert backend_pattern("[)?]\\)?x") == "^(?:[)?]\\)?x)$"  # not groups
    assert backend_pattern("[]?)](x)?") == "^(?:[]?)](x){0,1})$"


@pytest.mark.parametrize("backend", BOTH)
def test_one_of_needs_disjoint_branches(backend: str) -> None:
    circle = {"properties": {"kind": {"const": "circle"}, "r": NUM}, "required": ["kind", "r"]}
    square = {"properties": {"kind": {"enum": ["square", "box"]}, "side": NUM}, "required": ["kind"]}
    check_schema({"oneOf": [circle, square]}, backend)
    check_schema({"oneOf": [INT, {"type": "string"}, {"type": "null"}]}, backend)
    check_schema({"oneOf": [{"const": "a"}, {"enum": ["b", "c"]}]}, backend)
    check_schema({"$defs": {"c": circle}, "oneOf": [{"$ref": "#/$defs/c"}, square]}, backend)
    error = refusal({"oneOf": [INT, NUM]}, backend)
    assert "branches 0 and 1 may both match" in str(error) and error.param == "oneOf"
    loose = {"properties": {"kind": {"const": "circle"}}}  # kind not required: {} matches both
    assert refusal({"oneOf": [loose, square]}, backend).param == "oneOf"


def test_refs() -> None:
    escaped = {
        "$defs": {"a/b": INT, "c~d": INT},
        "anyOf": [{"$ref": "#/$defs/a~1b"}, {"$ref": "#/$defs/c~0d"}],
    }
    check_schema(escaped, "xgrammar")
    assert "escape" in str(refusal(escaped, "outlines"))
    for backend in BOTH:
        assert "local" in str(refusal({"$ref": "https://example.com/s.json"}, backend))
        assert refusal({"properties": {"a": {"$ref": "#/$defs/nope"}}}, backend).param == "properties.a.$ref"
    recursive = {"properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
    check_schema(recursive, "xgrammar")
    error = refusal(recursive, "outlines")
    assert "recursive" in str(error) and error.param == "properties.next.anyOf[0].$ref"
    chain: dict[str, Any] = {"$defs": {"d0": INT}}
    for i in range(1, OUTLINES_MAX_REF_DEPTH + 1):
        chain["$defs"][f"d{i}"] = {"$ref": f"#/$defs/d{i - 1}"}
    chain["$ref"] = f"#/$defs/d{OUTLINES_MAX_REF_DEPTH}"
    check_schema(chain, "xgrammar")
    assert "references deep" in str(refusal(chain, "outlines"))


@pytest.mark.parametrize("backend", BOTH)
def test_rewrite(backend: str) -> None:
    schema = {
        "title": "t",
        "$defs": {"d": {"type": "string", "format": "uuid"}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/d"}, "b": {"const": {"k": [1]}}, "c": True},
        "required": ["a"],
    }
    rewritten = load_schema(json.dumps(schema), backend)
    assert isinstance(rewritten, dict) and "title" not in rewritten
    assert rewritten["$defs"]["d"]["pattern"].startswith("^(?:[0-9a-f]{8}-")
    assert rewritten["properties"]["b"] == {
        "type": "object",
        "properties": {"k": {"type": "array", "prefixItems": [{"const": 1}], "items": False, "minItems": 1}},
        "required": ["k"],
        "additionalProperties": False,
    }
    assert rewritten["properties"]["c"] == ({} if backend == "outlines" else True)
    short = {"type": "string", "minLength": 1, "maxLength": 4, "description": "d"}
    assert load_schema(json.dumps(short), backend) == {"type": "string", "minLength": 1, "maxLength": 4}


def test_tool_trigger_specs() -> None:
    good = {
        "triggers": ["<tool_call>"],
        "tags": [{"begin": "<tool_call>", "schema": INT, "end": "</tool_call>"}],
    }
    tools = load_tool_triggers(json.dumps(good), "xgrammar")
    assert tools.triggers == ("<tool_call>",) and tools.tags[0].end == "</tool_call>"
    bad_begin = {**good, "tags": [{"begin": "<call>", "schema": INT, "end": ""}]}
    bad_schema = {
        **good,
        "tags": [{"begin": "<tool_call>", "schema": {"type": "number", "multipleOf": 2}, "end": ""}],
    }
    cases = [
        ("[]", "triggers"),
        (json.dumps({"triggers": [""], "tags": []}), "triggers"),
        (json.dumps({"triggers": ["<t>"], "tags": []}), "tags"),
        (json.dumps({"triggers": ["<t>"], "tags": [{"begin": "<t>"}]}), "tags[0]"),
        (json.dumps(bad_begin), "tags[0].begin"),
        (json.dumps(bad_schema), "tags[0].schema.multipleOf"),
        ("{", ""),
    ]
    for spec, param in cases:
        with pytest.raises(GrammarError) as info:
            load_tool_triggers(spec, "xgrammar")
        assert info.value.param == param, spec
