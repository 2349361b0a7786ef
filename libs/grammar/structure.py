"""The STRUCTURE constraint: a small grammar tree whose leaves may be special tokens. Pure.

Call syntaxes such as DeepSeek's DSML put special tokens inside their markup
(``<｜DSML｜ invoke name="f">``): no byte string spells them, so a byte-level grammar cannot
reach them. A structure names such a token by id, beside literal text, JSON values per a schema,
raw strings per a string schema, regexes and free text. The spec is JSON, one object per node:

- ``{"lit": str}``: the text; ``{"token": id}``: that one token (a special token's only way in);
- ``{"json": schema}``: a JSON value following ``schema`` (checked and rewritten as any schema);
- ``{"string": schema}``: raw text (no quotes, no escapes) that a string schema allows: one of
  its ``const``/``enum`` strings, its ``pattern``, ``minLength``/``maxLength``, else any text;
- ``{"regex": str}``: text matching the pattern; ``{"text": true}``: any text;
- ``{"seq": [...]}``, ``{"or": [...]}``, ``{"opt": node}``, ``{"star": node}``, ``{"plus": node}``;
- ``{"after": trigger, "then": node}``: free text until ``trigger`` (a ``token`` or ``lit``
  node) appears, then ``node``; the output ends there. Without the trigger, the text is all.

``text``, ``string`` and ``after`` nodes may add ``"excludes": [str]``: strings their free text
never contains (a call syntax's markup, in any spelling: whether its token's or plain tokens').
Free text never contains a special token: grammar vocabularies spell them as bytes no UTF-8
text holds (``SPECIAL_BYTES`` in libs.grammar.backend), so only a ``token`` node admits one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from libs.grammar.backend import GrammarError
from libs.grammar.constraint import load_schema_value

MAX_NODES: Final = 20_000  # a structure is built by the recipe from tools; this bounds a hostile one


@dataclass(frozen=True, slots=True)
class Lit:
    text: str


@dataclass(frozen=True, slots=True)
class Token:
    token_id: int


@dataclass(frozen=True, slots=True)
class Json:
    schema: object  # checked and rewritten for the backend


@dataclass(frozen=True, slots=True)
class RawString:
    """Raw text a string schema allows: ``choices`` when it lists them, else ``regex`` when it
    constrains the text, else any text without ``excludes``."""

    choices: tuple[str, ...] | None
    regex: str | None
    excludes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Regex:
    pattern: str


@dataclass(frozen=True, slots=True)
class Text:
    excludes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Seq:
    items: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Or:
    items: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Repeat:
    item: Node
    min_count: int  # 0: optional or star; 1: plus
    max_one: bool  # optional (at most once)


@dataclass(frozen=True, slots=True)
class After:
    trigger: Token | Lit
    then: Node
    excludes: tuple[str, ...] = ()  # of the free text before the trigger


Node: TypeAlias = Lit | Token | Json | RawString | Regex | Text | Seq | Or | Repeat | After


def load_structure(spec: str, backend: str) -> Node:
    """The tree in ``spec``, checked (schemas for ``backend``). Raises GrammarError."""
    try:
        data = json.loads(spec)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise GrammarError(f"spec is not valid JSON ({exc})") from None
    counter = [0]
    try:
        return _node(data, backend, counter, "structure")
    except RecursionError:
        raise GrammarError("the structure nests too deeply") from None


def token_ids(node: Node) -> set[int]:
    """Every token id the structure names."""
    if isinstance(node, Token):
        return {node.token_id}
    if isinstance(node, Seq | Or):
        return set().union(*(token_ids(item) for item in node.items))
    if isinstance(node, Repeat):
        return token_ids(node.item)
    if isinstance(node, After):
        return token_ids(node.trigger) | token_ids(node.then)
    return set()


def triggers(node: Node) -> list[Token | Lit]:
    """The triggers of the structure's ``after`` nodes (each opens a constrained part)."""
    if isinstance(node, After):
        return [node.trigger, *triggers(node.then)]
    if isinstance(node, Seq | Or):
        return [trigger for item in node.items for trigger in triggers(item)]
    if isinstance(node, Repeat):
        return triggers(node.item)
    return []


_SINGLE: Final = ("lit", "token", "json", "string", "regex", "text", "seq", "or", "opt", "star", "plus")


def _node(data: Any, backend: str, counter: list[int], where: str) -> Node:
    counter[0] += 1
    if counter[0] > MAX_NODES:
        raise GrammarError(f"a structure may have at most {MAX_NODES} nodes", param=where)
    if not isinstance(data, dict):
        raise GrammarError(f"{where} must be an object", param=where)
    data = dict(data)
    excludes = _excludes(data.pop("excludes", []), where)
    if set(data) == {"after", "then"}:
        trigger = _node(data["after"], backend, counter, f"{where}.after")
        if not isinstance(trigger, Token | Lit) or trigger == Lit(""):
            raise GrammarError(f"{where}.after must be a token or a non-empty literal", param=where)
        return After(trigger, _node(data["then"], backend, counter, f"{where}.then"), excludes)
    if len(data) != 1 or next(iter(data)) not in _SINGLE:
        raise GrammarError(f"{where} must have one key of {', '.join(_SINGLE)} (or after/then)", param=where)
    key, value = next(iter(data.items()))
    if excludes and key not in ("text", "string"):
        raise GrammarError(f"{where}: only text, string and after nodes take excludes", param=where)
    if key == "text":
        if value is not True:
            raise GrammarError(f"{where}.text must be true", param=f"{where}.text")
        return Text(excludes)
    if key == "string":
        raw = _raw_string(load_schema_value(value, backend, f"{where}.string"), where)
        return RawString(raw.choices, raw.regex, excludes)
    if key in ("lit", "token", "regex"):
        return _leaf(key, value, where)
    return _inner(key, value, backend, counter, where)


def _excludes(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise GrammarError(f"{where}.excludes must be a list of non-empty strings", param=f"{where}.excludes")
    return tuple(value)


def _leaf(key: str, value: Any, where: str) -> Node:
    if key == "lit" and isinstance(value, str):
        return Lit(value)
    if key == "token" and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return Token(value)
    if key == "regex" and isinstance(value, str):
        return Regex(value)
    expected = {"lit": "a string", "token": "a token id", "regex": "a pattern"}[key]
    raise GrammarError(f"{where}.{key} must be {expected}", param=f"{where}.{key}")


def _inner(key: str, value: Any, backend: str, counter: list[int], where: str) -> Node:
    if key == "json":
        return Json(load_schema_value(value, backend, f"{where}.json"))
    if key in ("seq", "or"):
        if not isinstance(value, list) or not value:
            raise GrammarError(f"{where}.{key} must be a non-empty list", param=f"{where}.{key}")
        items = tuple(_node(item, backend, counter, f"{where}.{key}[{i}]") for i, item in enumerate(value))
        return Seq(items) if key == "seq" else Or(items)
    item = _node(value, backend, counter, f"{where}.{key}")
    return Repeat(item, min_count=1 if key == "plus" else 0, max_one=key == "opt")


def _raw_string(schema: object, where: str) -> RawString:
    """A (rewritten) string schema as raw text: listed values, or a pattern, or lengths."""
    if not isinstance(schema, dict) or schema.get("type", "string") != "string":
        raise GrammarError(f"{where}.string must be a string schema", param=f"{where}.string")
    listed = [schema["const"]] if "const" in schema else schema.get("enum")
    if listed is not None:
        if not all(isinstance(value, str) for value in listed):
            raise GrammarError(f"{where}.string lists a value that is not a string", param=f"{where}.string")
        return RawString(tuple(listed), None)
    if "pattern" in schema:
        return RawString(None, str(schema["pattern"]))
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if low or high is not None:
        return RawString(None, f"[\\s\\S]{{{low},{'' if high is None else high}}}")
    return RawString(None, None)
