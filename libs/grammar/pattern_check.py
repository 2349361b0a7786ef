"""Checks a JSON Schema ``pattern`` before a backend embeds it in the grammar of a JSON string,
and spells it the way both backends read it right (``backend_pattern``).

Both backends put the pattern's text inside the string's quotes without JSON-escaping it, so a
pattern that can match ``"``, ``\\`` or a control character lets the model write broken JSON
(``"a"b"``, ``"a\\b"`` read as a backspace, a raw newline). Found by experiment
(tests/unit/grammar/test_keyword_tables.py): xgrammar confines character classes, ``.`` and class
escapes to JSON-safe characters itself and only lets such literal characters through; outlines
inserts everything verbatim, so every atom is checked. Pure: parses with Python's ``re`` parser,
whose syntax covers the ECMA-262 subset JSON Schema patterns use in practice.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# re's parser and op codes are private modules; their shapes are stable across 3.11-3.13.
from re import _constants as sre  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any, Final

# Characters a raw JSON string may not contain (RFC 8259 section 7).
_UNSAFE: Final = ('"', "\\", *map(chr, range(0x20)))
_CATEGORY_REGEX: Final[dict[Any, str]] = {
    sre.CATEGORY_DIGIT: r"\d",
    sre.CATEGORY_NOT_DIGIT: r"\D",
    sre.CATEGORY_SPACE: r"\s",
    sre.CATEGORY_NOT_SPACE: r"\S",
    sre.CATEGORY_WORD: r"\w",
    sre.CATEGORY_NOT_WORD: r"\W",
}
# Backends that keep classes and wildcards JSON-safe on their own (see the module docstring).
SELF_ESCAPING: Final = frozenset({"xgrammar"})


def pattern_problem(pattern: str, backend: str) -> str | None:
    """Why ``pattern`` cannot be enforced inside a JSON string by ``backend`` (None: it can)."""
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as exc:
        return f"is not a valid regular expression ({exc})"
    if parsed.state.flags & ~re.UNICODE.value:
        return "uses inline flags, which are not supported"
    items = list(parsed)
    body = items[1 if items[:1] == [(sre.AT, sre.AT_BEGINNING)] else 0 :]
    if body[-1:] == [(sre.AT, sre.AT_END)]:
        body = body[:-1]
    return _items_problem(body, check_classes=backend not in SELF_ESCAPING)


def backend_pattern(pattern: str) -> str:
    """A checked pattern as both backends get it: anchored at both ends (both match the whole
    string; JSON Schema's search semantics only ever allow more), each optional group ``(...)?``
    spelled ``(...){0,1}``: xgrammar's JSON-string regexes mishandle an optional group holding a
    variable repetition (``^a(?:xb+)?$`` accepts "ab"), and the range form is exact on both."""
    items = list(sre_parse.parse(pattern))
    if items[:1] == [(sre.AT, sre.AT_BEGINNING)]:
        pattern = pattern[1:]
    if items[-1:] == [(sre.AT, sre.AT_END)]:
        pattern = pattern[:-1]
    return f"^(?:{_optional_groups_as_ranges(pattern)})$"


def _optional_groups_as_ranges(pattern: str) -> str:
    out: list[str] = []
    i = 0
    class_start = -1  # index of the '[' of the character class we are in, or -1
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if class_start >= 0:
            # ']' closes the class unless it is its first member ("[]a]", "[^]a]")
            if ch == "]" and i > class_start + 1 + (pattern[class_start + 1] == "^"):
                class_start = -1
        elif ch == "[":
            class_start = i
        elif ch == ")" and pattern[i + 1 : i + 2] == "?":
            out.append("){0,1}")
            i += 3 if pattern[i + 2 : i + 3] == "?" else 2  # lazy or not: the same full match
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def _items_problem(items: Iterable[tuple[Any, Any]], check_classes: bool) -> str | None:
    for op, av in items:
        problem = _op_problem(op, av, check_classes)
        if problem:
            return problem
    return None


def _op_problem(op: Any, av: Any, check_classes: bool) -> str | None:
    if op is sre.LITERAL:
        return _unsafe(chr(av)) if chr(av) in _UNSAFE else None
    if op in (sre.NOT_LITERAL, sre.ANY):
        return "can match '\"', '\\' or a control character" if check_classes else None
    if op is sre.IN:
        unsafe = [ch for ch in _UNSAFE if _class_matches(av, ch)]
        return _unsafe(unsafe[0]) if unsafe and check_classes else None
    if op is sre.SUBPATTERN:
        if av[1] or av[2]:
            return "uses inline flags, which are not supported"
        return _items_problem(av[3], check_classes)
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
        return _items_problem(av[2], check_classes)
    if op is sre.BRANCH:
        for branch in av[1]:
            problem = _items_problem(branch, check_classes)
            if problem:
                return problem
        return None
    if op is sre.AT:
        return "may only use '^' and '$' at its start and end"
    if op in (sre.ASSERT, sre.ASSERT_NOT):
        return "uses a lookaround, which is not supported"
    if op in (sre.GROUPREF, sre.GROUPREF_EXISTS):
        return "uses a backreference, which is not supported"
    return f"uses an unsupported construct ({str(op).lower()})"


def _class_matches(items: list[tuple[Any, Any]], ch: str) -> bool:
    negate = bool(items) and items[0][0] is sre.NEGATE
    hit = False
    for op, av in items:
        if op is sre.LITERAL:
            hit = hit or ord(ch) == av
        elif op is sre.RANGE:
            hit = hit or av[0] <= ord(ch) <= av[1]
        elif op is sre.CATEGORY:
            regex = _CATEGORY_REGEX.get(av)  # an unknown category counts as matching
            hit = hit or regex is None or re.fullmatch(regex, ch) is not None
    return hit != negate


def _unsafe(ch: str) -> str:
    return f"can match {ch!r}, which the backend would write unescaped into the JSON string"
