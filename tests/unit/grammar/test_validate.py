"""The gateway's validate(): no vocabulary, refuses whatever the worker would fail to compile, and
``import libs.grammar`` stays cheap (no grammar library imported until a constraint is checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from libs.grammar import BACKENDS, make_backend, validate
from libs.grammar.backend import GrammarError
from libs.protocol.messages import StructuredOutput, StructuredOutputKind

SCHEMA: dict[str, Any] = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TOOLS: dict[str, Any] = {
    "triggers": ["<tool_call>"],
    "tags": [{"begin": "<tool_call>", "schema": SCHEMA, "end": "</tool_call>"}],
}


def constraint(
    kind: StructuredOutputKind, spec: object, backend: str, prefix: str = "", suffix: str = ""
) -> StructuredOutput:
    text = spec if isinstance(spec, str) else json.dumps(spec)
    return StructuredOutput(kind, text, backend, prefix=prefix, suffix=suffix)


@pytest.mark.parametrize("backend", BACKENDS)
def test_accepts_every_kind(backend: str) -> None:
    validate(constraint(StructuredOutputKind.JSON, "", backend))
    validate(constraint(StructuredOutputKind.JSON_SCHEMA, SCHEMA, backend, prefix="<call>", suffix="</call>"))
    validate(constraint(StructuredOutputKind.REGEX, "[a-z]+( [a-z]+)*", backend))
    if backend == "xgrammar":
        validate(constraint(StructuredOutputKind.TOOL_TRIGGERS, TOOLS, backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kind,spec,fragment",
    [
        (StructuredOutputKind.REGEX, "[a-", "cannot compile"),
        (StructuredOutputKind.REGEX, "(ab", "cannot compile"),
        (StructuredOutputKind.JSON_SCHEMA, "{", "not valid JSON"),
        (StructuredOutputKind.JSON_SCHEMA, {"type": "number", "minimum": 5, "maximum": 1}, "minimum"),
        (StructuredOutputKind.JSON_SCHEMA, {"type": "string", "pattern": "a{2,1}"}, "pattern"),
        (StructuredOutputKind.TOOL_TRIGGERS, {"triggers": [], "tags": []}, "trigger"),
    ],
)
def test_refuses(backend: str, kind: StructuredOutputKind, spec: object, fragment: str) -> None:
    with pytest.raises(GrammarError, match=fragment):
        validate(constraint(kind, spec, backend))


def test_tool_trigger_errors_name_the_tag() -> None:
    tools = {**TOOLS, "tags": [{**TOOLS["tags"][0], "schema": {"type": "array", "uniqueItems": True}}]}
    with pytest.raises(GrammarError) as info:
        validate(constraint(StructuredOutputKind.TOOL_TRIGGERS, tools, "xgrammar"))
    assert info.value.param == "tags[0].schema.uniqueItems"
    with pytest.raises(GrammarError, match="tool triggers"):
        validate(constraint(StructuredOutputKind.TOOL_TRIGGERS, TOOLS, "outlines"))


def test_unknown_backend() -> None:
    with pytest.raises(GrammarError) as info:
        validate(constraint(StructuredOutputKind.JSON, "", "llguidance"))
    assert info.value.param == "backend"
    with pytest.raises(GrammarError):
        make_backend("llguidance", [b"a"])


def test_import_is_cheap() -> None:
    code = "import sys, libs.grammar; print(sorted({'xgrammar', 'outlines_core'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
