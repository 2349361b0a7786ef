"""The experiments behind schema_check's tables, replayed: a keyword is listed for a backend only
if that backend's matcher rejects text violating it, and is left out because the raw library
lets such text through. Matchers run over a one-byte-per-token vocabulary, so every text can be
fed byte by byte; id 256 is the stop token.

Library defects these probes found (and what the backends do about them):
- outlines-core 0.2.14 ignores number bounds, multipleOf, min/maxProperties, propertyNames,
  uniqueItems, contains, not, if/then; reads only one of pattern / maxLength; concatenates allOf
  branches; inserts patterns unescaped (a '.' can write a raw '"'); its date-time needs no UTC
  offset and its email/uri/time grammars can write raw quotes or backslashes; it drops every
  transition out of an accepting state into a non-accepting one ("1" never becomes "1.5"):
  fixed with an end marker (outlines_backend).
- xgrammar 0.2.9 ignores uniqueItems, contains, dependentRequired, not, if/then, multipleOf on
  numbers (and on integers beside a one-sided bound, or bounds 10000 or more apart); keeps one
  allOf branch; reads only one of pattern / maxLength; lets maxLength strings hold raw control
  characters (fixed: the grammar text is patched), literal '"' in patterns, Feb 31 as a date and
  leading zeros in an ipv4 (fixed: our own format patterns); accepts "ab" for '^a(?:xb+)?$'
  (fixed: optional groups are spelled {0,1}); reads its own printed "\\xe7a" as U+0E7A (fixed:
  grammar text is re-spelled); sets mask bits past the vocabulary (fixed: cleared); lets byte
  tokens spell surrogates / overlong UTF-8 (not fixed; real models do not write those).
"""

from __future__ import annotations

import itertools
import json
import random
import re
from typing import Any, NamedTuple

import pytest
import xgrammar as xgr

from libs.grammar import BACKENDS, make_backend
from libs.grammar.backend import CompiledGrammar, GrammarBackend, GrammarError
from libs.grammar.outlines_backend import OutlinesCompiled, build_index, make_vocabulary, schema_regex
from libs.grammar.schema_check import FORMATS, HONOURED, check_schema
from libs.grammar.xgrammar_backend import SEPARATORS, XGrammarCompiled
from libs.protocol.messages import StructuredOutput, StructuredOutputKind

BYTE_VOCAB = [bytes([b]) for b in range(256)] + [b""]
STOP = 256
INT: dict[str, Any] = {"type": "integer"}
STR: dict[str, Any] = {"type": "string"}


class Probe(NamedTuple):
    keyword: str
    schema: dict[str, Any]
    good: tuple[str, ...]  # texts the schema allows, written in our JSON style
    bad: tuple[str, ...]  # texts that violate the keyword


PROBES = [
    Probe("type", {"type": ["string", "null"]}, ('"a"', "null"), ("1", "true")),
    Probe("type", {"type": "number"}, ("1.5", "-2e+3", "3"), ('"a"', "01")),
    Probe("enum", {"enum": ["a", 1, None]}, ('"a"', "1", "null"), ('"b"', "2")),
    Probe(
        "enum",
        {
            "properties": {"e": {"enum": ["français"]}, "s": {"type": "string", "maxLength": 1}},
            "required": ["e", "s"],
        },
        ('{"e": "français", "s": ""}',),
        ('{"e": "fran\u0e7ais", "s": ""}', '{"e": "fran\\u00e7ais", "s": ""}'),
    ),
    Probe("const", {"const": {"a": [1, 2]}}, ('{"a": [1, 2]}',), ('{"a":[1,2]}', '{"a": [1]}')),
    Probe("const", {"const": {'a"b': [1]}}, ('{"a\\"b": [1]}',), ('{"a"b": [1]}', '{"a\\"b": [2]}')),
    Probe("anyOf", {"anyOf": [INT, {"type": "boolean"}]}, ("1", "true"), ('"a"',)),
    Probe("oneOf", {"oneOf": [INT, {"type": "boolean"}]}, ("1", "true"), ('"a"',)),
    Probe("allOf", {"allOf": [{"type": "string", "maxLength": 2}]}, ('"ab"',), ('"abc"',)),
    Probe("$ref", {"$defs": {"x": INT}, "$ref": "#/$defs/x"}, ("1",), ('"a"',)),
    Probe("$defs", {"$defs": {"x": STR}, "$ref": "#/$defs/x"}, ('"a"',), ("1",)),
    Probe("definitions", {"definitions": {"x": INT}, "$ref": "#/definitions/x"}, ("1",), ('"a"',)),
    Probe(
        "properties",
        {"properties": {"a": INT, "b": STR}},
        ('{"a": 1, "b": "x"}', "{}"),
        ('{"a": "x"}', '{"b": "x", "a": 1}'),
    ),
    Probe(
        "required",
        {"type": "object", "properties": {"a": INT, "b": INT, "c": INT}, "required": ["b"]},
        ('{"b": 1}', '{"a": 1, "b": 2, "c": 3}'),
        ('{"a": 1}', "{}", '{"a": 1, "c": 3}'),
    ),
    Probe(
        "additionalProperties",
        {"type": "object", "additionalProperties": INT},
        ('{"x": 1}', "{}"),
        ('{"x": "s"}',),
    ),
    Probe(
        "additionalProperties",
        {"type": "object", "properties": {"a": INT}, "additionalProperties": False},
        ('{"a": 1}',),
        ('{"a": 1, "b": 2}',),
    ),
    Probe(
        "minProperties",
        {"type": "object", "additionalProperties": INT, "minProperties": 2},
        ('{"x": 1, "y": 2}',),
        ('{"x": 1}',),
    ),
    Probe(
        "maxProperties",
        {"type": "object", "additionalProperties": INT, "maxProperties": 1},
        ('{"x": 1}',),
        ('{"x": 1, "y": 2}',),
    ),
    Probe(
        "propertyNames",
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": INT},
        ('{"ab": 1}',),
        ('{"A": 1}',),
    ),
    Probe("items", {"type": "array", "items": STR}, ('["a", "b"]', "[]"), ("[1]", '["a","b"]')),
    Probe(
        "prefixItems",
        {"type": "array", "prefixItems": [INT, STR], "items": False},
        ('[1, "a"]',),
        ('["a", 1]', '[1, "a", 2]'),
    ),
    Probe("minItems", {"type": "array", "items": INT, "minItems": 2}, ("[1, 2]",), ("[1]",)),
    Probe("maxItems", {"type": "array", "items": INT, "maxItems": 2}, ("[1, 2]",), ("[1, 2, 3]",)),
    Probe("minLength", {"type": "string", "minLength": 2}, ('"ab"', '"éé"'), ('"a"', '""')),
    Probe("maxLength", {"type": "string", "maxLength": 2}, ('"ab"', '"éé"'), ('"abc"', '"ééé"', '"a\x01"')),
    Probe("pattern", {"type": "string", "pattern": "^[a-z]{2}$"}, ('"ab"',), ('"abc"', '"A1"')),
    Probe("pattern", {"type": "string", "pattern": "[0-9]"}, ('"5"',), ('"x"',)),
    Probe("pattern", {"type": "string", "pattern": "^a(?:xb+)?$"}, ('"a"', '"axbb"'), ('"ab"', '"ax"')),
    Probe("minimum", {"type": "integer", "minimum": -3}, ("-3", "100"), ("-4",)),
    Probe("maximum", {"type": "number", "maximum": 1.5}, ("1.5", "-2"), ("1.6", "2")),
    Probe("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, ("0.1", "2"), ("0", "-1", "0.0")),
    Probe("exclusiveMaximum", {"type": "integer", "exclusiveMaximum": 3}, ("2",), ("3",)),
    Probe("multipleOf", {"type": "integer", "multipleOf": 3}, ("6", "-3"), ("7",)),
    Probe(
        "multipleOf",
        {"type": "integer", "multipleOf": 5, "minimum": -7, "maximum": 9990},
        ("-5", "9990"),
        ("7", "-10"),
    ),
    Probe(
        "format",
        {"type": "string", "format": "date"},
        ('"2024-02-29"', '"2023-12-31"'),
        ('"2023-02-29"', '"2023-09-31"'),
    ),
    Probe(
        "format",
        {"type": "string", "format": "time"},
        ('"10:20:30Z"', '"10:20:30.5+01:00"'),
        ('"10:20:30"', '"10:20:305Z"'),
    ),
    Probe(
        "format",
        {"type": "string", "format": "date-time"},
        ('"2024-01-31T10:20:30Z"',),
        ('"2024-01-31T10:20:30"',),
    ),
    Probe("format", {"type": "string", "format": "email"}, ('"a.b@example.com"',), ('"abc"', '""a"@b.com"')),
    Probe(
        "format",
        {"type": "string", "format": "uuid"},
        ('"123e4567-e89b-12d3-a456-426614174000"',),
        ('"123e4567"',),
    ),
    Probe("format", {"type": "string", "format": "ipv4"}, ('"192.168.1.1"',), ('"256.1.1.1"', '"01.2.3.4"')),
    Probe("format", {"type": "string", "format": "ipv6"}, ('"::1"', '"2001:db8::1"'), ('"x"', '":::"')),
]


class Defect(NamedTuple):
    backend: str
    keyword: str
    schema: dict[str, Any]
    violating: str  # text the raw library accepts although the schema forbids it
    fixed: bool = False  # True: the backend rewrites the schema so it holds; False: refused


# (keyword, schema, violating text) for keywords neither library enforces
_BOTH_IGNORE: list[tuple[str, dict[str, Any], str]] = [
    ("uniqueItems", {"type": "array", "items": INT, "uniqueItems": True}, "[1, 1]"),
    ("contains", {"type": "array", "items": INT, "contains": {"const": 2}}, "[1]"),
    ("not", {"type": "integer", "not": {"const": 3}}, "3"),
    ("if", {"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 5}}, "6"),
    (
        "dependentRequired",
        {"properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
        '{"a": 1}',
    ),
    ("$ref", {"$defs": {"x": STR}, "$ref": "#/$defs/x", "type": "integer"}, '"a"'),
]

DEFECTS = [
    *(
        Defect("outlines", keyword, {"type": "integer", keyword: 3}, text)
        for keyword, text in [
            ("minimum", "2"),
            ("maximum", "4"),
            ("exclusiveMinimum", "3"),
            ("multipleOf", "4"),
        ]
    ),
    Defect(
        "outlines",
        "maxProperties",
        {"type": "object", "additionalProperties": INT, "maxProperties": 1},
        '{"a": 1, "b": 2}',
    ),
    Defect(
        "outlines",
        "minProperties",
        {"type": "object", "additionalProperties": INT, "minProperties": 2},
        '{"a": 1}',
    ),
    Defect(
        "outlines",
        "propertyNames",
        {"type": "object", "additionalProperties": INT, "propertyNames": {"maxLength": 1}},
        '{"ab": 1}',
    ),
    Defect("outlines", "allOf", {"allOf": [{"type": "integer"}, {"type": "integer"}]}, "12"),
    Defect("outlines", "pattern", {"type": "string", "pattern": "^.{1,3}$"}, '"a"b"'),
    Defect("outlines", "maxLength", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}, '"A1"'),
    Defect("outlines", "format", {"type": "string", "format": "date-time"}, '"2024-01-31T10:20:30"', True),
    Defect("outlines", "format", {"type": "string", "format": "email"}, '""a"@b.com"', True),
    Defect("xgrammar", "multipleOf", {"type": "number", "multipleOf": 0.5}, "1.2"),
    Defect("xgrammar", "multipleOf", {"type": "integer", "multipleOf": 5, "maximum": 28}, "27"),
    Defect(
        "xgrammar", "multipleOf", {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 10000}, "3"
    ),
    Defect(
        "xgrammar",
        "allOf",
        {"allOf": [{"type": "integer", "maximum": 5}, {"type": "integer", "minimum": 3}]},
        "6",
    ),
    Defect("xgrammar", "maxLength", {"type": "string", "maxLength": 3}, '"a\x01"', True),
    Defect("xgrammar", "maxLength", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}, '"abc"'),
    Defect("xgrammar", "pattern", {"type": "string", "pattern": '^a"b$'}, '"a"b"'),
    Defect("xgrammar", "pattern", {"type": "string", "pattern": "^a(?:xb+)?$"}, '"ab"', True),
    Defect("xgrammar", "format", {"type": "string", "format": "date"}, '"2023-09-31"', True),
    Defect("xgrammar", "format", {"type": "string", "format": "ipv4"}, '"01.2.3.4"', True),
    Defect("xgrammar", "required", {"type": "object", "required": ["a"]}, "{}"),
    *(
        Defect(backend, keyword, schema, text)
        for backend in BACKENDS
        for keyword, schema, text in _BOTH_IGNORE
    ),
]


@pytest.fixture(scope="module")
def byte_backends() -> dict[str, GrammarBackend]:
    return {name: make_backend(name, BYTE_VOCAB) for name in BACKENDS}


def compile_schema(backend: GrammarBackend, schema: object) -> CompiledGrammar:
    return backend.compile(
        StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(schema), backend.name)
    )


def accepts(compiled: CompiledGrammar, text: str) -> bool:
    matcher = compiled.matcher([STOP])
    return all(matcher.advance(b) for b in text.encode()) and matcher.advance(STOP)


def raw_compile(backend: str, schema: object) -> CompiledGrammar:
    """The library's own reading of ``schema``: no check, no rewrite (our JSON style, though)."""
    if backend == "xgrammar":
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=False, separators=SEPARATORS
        )
        info = xgr.TokenizerInfo(BYTE_VOCAB, xgr.VocabType.RAW, vocab_size=len(BYTE_VOCAB))
        return XGrammarCompiled(xgr.GrammarCompiler(info, cache_enabled=False).compile_grammar(grammar))
    index = build_index(schema_regex(schema) + "\\x00", make_vocabulary(BYTE_VOCAB))
    return OutlinesCompiled(index, len(BYTE_VOCAB))


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_honoured_keyword_and_format_has_a_probe(backend: str) -> None:
    probed = {probe.keyword for probe in PROBES if _accepted(probe.schema, backend)}
    assert HONOURED[backend] <= probed
    formats = {probe.schema["format"] for probe in PROBES if probe.keyword == "format"}
    assert formats >= FORMATS[backend]


def _accepted(schema: object, backend: str) -> bool:
    try:
        check_schema(schema, backend)
    except GrammarError:
        return False
    return True


def _accepted_probes() -> list[tuple[Probe, str]]:
    """Each probe on each backend that accepts its schema (a refusal is checked by the tables'
    own tests: the backend must name the keyword it cannot enforce)."""
    return [(p, b) for p in PROBES for b in BACKENDS if _accepted(p.schema, b)]


@pytest.mark.parametrize(
    ("probe", "backend"),
    _accepted_probes(),
    ids=[f"{p.keyword}-{PROBES.index(p)}-{b}" for p, b in _accepted_probes()],
)
def test_probe(probe: Probe, backend: str, byte_backends: dict[str, GrammarBackend]) -> None:
    compiled = compile_schema(byte_backends[backend], probe.schema)
    assert [text for text in probe.good if not accepts(compiled, text)] == []
    assert [text for text in probe.bad if accepts(compiled, text)] == []


@pytest.mark.parametrize(
    "defect", DEFECTS, ids=[f"{d.backend}-{d.keyword}-{i}" for i, d in enumerate(DEFECTS)]
)
def test_raw_library_defect_is_fixed_or_refused(
    defect: Defect, byte_backends: dict[str, GrammarBackend]
) -> None:
    """The raw library lets the violating text through, so the backend must rewrite the schema
    until it holds, or check_schema must refuse it naming the keyword. (If a library fixes a
    defect, the first assertion fails: time to revisit the table.)"""
    assert accepts(raw_compile(defect.backend, defect.schema), defect.violating)
    if defect.fixed:
        assert not accepts(compile_schema(byte_backends[defect.backend], defect.schema), defect.violating)
    else:
        with pytest.raises(GrammarError, match=re.escape(defect.keyword)):
            check_schema(defect.schema, defect.backend)


def test_outlines_index_loses_continuations_past_an_accepting_state() -> None:
    vocabulary = make_vocabulary(BYTE_VOCAB)
    index = build_index("1(\\.5)?", vocabulary)  # no end marker: the library alone
    after_one = index.get_next_state(index.get_initial_state(), ord("1"))
    assert index.get_next_state(after_one, ord(".")) is None
    regex = StructuredOutput(StructuredOutputKind.REGEX, "1(\\.5)?", "outlines")
    compiled = make_backend("outlines", BYTE_VOCAB).compile(regex)
    assert accepts(compiled, "1.5") and accepts(compiled, "1") and not accepts(compiled, "1.")


def _random_pattern(rng: random.Random, depth: int = 0) -> str:
    roll = rng.random()
    if depth > 2 or roll < 0.4:
        atom = rng.choice(["a", "b", "x", "[ab]", "[a-b]"])
    elif roll < 0.65:
        atom = f"(?:{_random_pattern(rng, depth + 1)}{_random_pattern(rng, depth + 1)})"
    elif roll < 0.8:
        atom = f"(?:{_random_pattern(rng, depth + 1)}|{_random_pattern(rng, depth + 1)})"
    else:
        atom = f"({_random_pattern(rng, depth + 1)})"
    return atom + rng.choice(["", "", "?", "*", "+", "{1,2}", "{0,2}", "{2}"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_patterns_and_regexes_match_exactly_what_python_matches(
    backend: str, byte_backends: dict[str, GrammarBackend]
) -> None:
    """Random patterns over {a, b, x}: as a JSON Schema pattern, as one beside a maxLength string
    and a non-ASCII enum (xgrammar then reads its own grammar text back), and as a REGEX
    constraint, the backend accepts exactly the strings (up to 4 characters) re.fullmatch accepts.
    (Some random regexes take outlines tens of seconds to index, e.g. a bounded repeat at the start
    of a REGEX constraint; this seed draws none of them.)"""
    rng = random.Random(1)
    strings = ["".join(chars) for n in range(5) for chars in itertools.product("abx", repeat=n)]
    for _ in range(12):
        pattern = _random_pattern(rng) + _random_pattern(rng)
        expected = [s for s in strings if re.fullmatch(pattern, s)]
        alone = compile_schema(byte_backends[backend], {"type": "string", "pattern": pattern})
        assert [s for s in strings if accepts(alone, json.dumps(s))] == expected, pattern
        beside = compile_schema(byte_backends[backend], _beside_length_and_enum(pattern))
        in_object = [s for s in strings if accepts(beside, f'{{"p": {json.dumps(s)}, "s": "", "e": "ça"}}')]
        assert in_object == expected, pattern
        regex = StructuredOutput(StructuredOutputKind.REGEX, pattern, backend)
        whole = byte_backends[backend].compile(regex)
        assert [s for s in strings if accepts(whole, s)] == expected, pattern


def _beside_length_and_enum(pattern: str) -> dict[str, Any]:
    properties = {
        "p": {"type": "string", "pattern": pattern},
        "s": {"type": "string", "maxLength": 1},
        "e": {"enum": ["ça", "b"]},
    }
    return {"type": "object", "properties": properties, "required": list(properties)}
