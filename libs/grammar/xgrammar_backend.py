"""The xgrammar backend: a constraint becomes one xgrammar Grammar (prefix, constrained part,
suffix), compiled against the vocabulary into per-state token masks; a GrammarMatcher walks it.

JSON is written as json.dumps writes it: ", " between items, ": " after keys, no other whitespace.
Imported lazily by libs.grammar: xgrammar imports torch and transformers (about two seconds).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import torch
import xgrammar as xgr

from libs.grammar.backend import GrammarError
from libs.grammar.constraint import (
    CallOrFormat,
    ToolTriggers,
    load_call_or_format,
    load_schema,
    load_tool_triggers,
)
from libs.grammar.structure import (
    After,
    Json,
    Lit,
    Node,
    Or,
    RawString,
    Regex,
    Repeat,
    Seq,
    Text,
    Token,
    load_structure,
    token_ids,
)
from libs.protocol.messages import StructuredOutput, StructuredOutputKind

NAME: Final = "xgrammar"
SEPARATORS: Final = (", ", ": ")
# xgrammar 0.2.9 spells each character of a string with minLength/maxLength as this class, which
# lets raw control characters through (invalid JSON); the grammar text is patched to exclude them.
_LENGTH_CHAR: Final = '[^\\"\\\\\\r\\n]'
_JSON_CHAR: Final = '[^\\0-\\x1f\\"\\\\]'
# xgrammar prints a code point below 256 as \xHH but reads \x with every hex digit that follows
# (fran\xe7ais comes back as U+0E7A + "is"), so grammar text is re-spelled with \u00HH.
_ESCAPE: Final = re.compile(r"\\(x[0-9a-fA-F]{2}|.)")
_LOG_PREFIX: Final = re.compile(r"^\[[^\]]*\] \S+: ")  # "[21:08:08] /project/cpp/x.cc:5082: "
# A matcher's parser states print as "... Last step: [ParserState(rule_id=.., ..., rule_start_pos=..)]";
# without the input positions, states that differ only in where their rules began look alike.
_POSITION: Final = re.compile(r"rule_start_pos=-?\d+")


def schema_grammar(schema: object) -> xgr.Grammar:
    """A JSON Schema (already checked and rewritten) as a grammar in our JSON style."""
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=SEPARATORS)
    text = grammar_text(grammar)
    if _LENGTH_CHAR in text:
        grammar = xgr.Grammar.from_ebnf(text.replace(_LENGTH_CHAR, _JSON_CHAR))
    return grammar


def grammar_text(grammar: xgr.Grammar) -> str:
    """EBNF text that xgrammar reads back as the same grammar."""
    return _ESCAPE.sub(lambda m: "\\u00" + m[1][1:] if m[1][0] == "x" else m[0], str(grammar))


def literal_grammar(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(f"root ::= {_ebnf_string(text)}")


def tool_grammar(tools: ToolTriggers) -> xgr.Grammar:
    """Free text; each trigger opens a tag: its begin text, a JSON body per its schema, its end text."""
    tags = [
        {
            "type": "tag",
            "begin": tag.begin,
            "content": {"type": "grammar", "grammar": grammar_text(schema_grammar(tag.schema))},
            "end": tag.end,
        }
        for tag in tools.tags
    ]
    structural = {"type": "triggered_tags", "triggers": list(tools.triggers), "tags": tags}
    return xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": structural}))


def build_grammar(constraint: StructuredOutput, vocab_size: int | None = None) -> xgr.Grammar:
    """The whole constraint as one grammar (no vocabulary needed; with ``vocab_size``, a
    structure's token ids are checked against it). Raises GrammarError."""
    if constraint.backend != NAME:
        raise GrammarError(f"constraint is for backend {constraint.backend!r}, not {NAME}", param="backend")
    try:
        parts = [_body(constraint, vocab_size)]
        if constraint.prefix:
            parts.insert(0, literal_grammar(constraint.prefix))
        if constraint.suffix:
            parts.append(literal_grammar(constraint.suffix))
        return xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0]
    except GrammarError:
        raise
    except (RuntimeError, ValueError) as exc:
        raise GrammarError(f"the xgrammar backend cannot compile this constraint: {_reason(exc)}") from None


def _body(constraint: StructuredOutput, vocab_size: int | None) -> xgr.Grammar:
    kind = constraint.kind
    if kind == StructuredOutputKind.JSON:
        return schema_grammar({"type": "object"})
    if kind == StructuredOutputKind.JSON_SCHEMA:
        return schema_grammar(load_schema(constraint.spec, NAME))
    if kind == StructuredOutputKind.REGEX:
        return xgr.Grammar.from_regex(constraint.spec)
    if kind == StructuredOutputKind.TOOL_TRIGGERS:
        return tool_grammar(load_tool_triggers(constraint.spec, NAME))
    if kind == StructuredOutputKind.CALL_OR_FORMAT:
        return call_or_format_grammar(load_call_or_format(constraint.spec, NAME))
    if kind == StructuredOutputKind.STRUCTURE:
        structure = load_structure(constraint.spec, NAME)
        named = token_ids(structure)
        if vocab_size is not None and named and max(named) >= vocab_size:
            raise GrammarError(f"token id {max(named)} is outside the vocabulary", param="token")
        return structure_grammar(structure)
    raise GrammarError(f"unknown constraint kind {kind!r}", param="kind")


def call_or_format_grammar(union: CallOrFormat) -> xgr.Grammar:
    """Either the format, whole, or one tag: its begin text, a JSON body per its schema, its end."""
    fmt = xgr.Grammar.from_regex(union.regex) if union.regex is not None else schema_grammar(union.schema)
    elements: list[dict[str, Any]] = [{"type": "grammar", "grammar": grammar_text(fmt)}]
    for tag in union.tags:
        content = {"type": "grammar", "grammar": grammar_text(schema_grammar(tag.schema))}
        elements.append({"type": "tag", "begin": tag.begin, "content": content, "end": tag.end})
    structural = {"type": "or", "elements": elements}
    return xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": structural}))


def structure_grammar(node: Node) -> xgr.Grammar:
    """A structure (libs/grammar/structure.py) as one xgrammar structural tag."""
    return xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": _format(node)}))


def _format(node: Node) -> dict[str, Any]:
    """One node as a structural-tag format; tokens by id, sub-grammars as EBNF text."""
    if isinstance(node, Lit):
        return {"type": "const_string", "value": node.text}
    if isinstance(node, Token):
        return {"type": "token", "token": node.token_id}
    if isinstance(node, Json):
        return _sub_grammar(schema_grammar(node.schema))
    if isinstance(node, RawString):
        if node.choices is not None:
            return {"type": "or", "elements": [_format(Lit(choice)) for choice in node.choices]}
        if node.regex is not None:
            return _sub_grammar(xgr.Grammar.from_regex(node.regex))
        return _text_format(node.excludes)
    if isinstance(node, Regex):
        return _sub_grammar(xgr.Grammar.from_regex(node.pattern))
    if isinstance(node, Text):
        return _text_format(node.excludes)
    if isinstance(node, Seq | Or):
        kind = "sequence" if isinstance(node, Seq) else "or"
        return {"type": kind, "elements": [_format(item) for item in node.items]}
    if isinstance(node, Repeat):
        kind = "optional" if node.max_one else "plus" if node.min_count else "star"
        return {"type": kind, "content": _format(node.item)}
    return _after_format(node)


def _after_format(node: After) -> dict[str, Any]:
    # Text-level free text (so no special token but the trigger), then, at most once, the trigger
    # and what follows it: the output ends there. (xgrammar's token-triggered tags would make the
    # free text token-level, where every special token passes.)
    triggered = {"type": "sequence", "elements": [_format(node.trigger), _format(node.then)]}
    free = _text_format(node.excludes)
    return {"type": "sequence", "elements": [free, {"type": "optional", "content": triggered}]}


def _text_format(excludes: Sequence[str]) -> dict[str, Any]:
    """Any text without ``excludes``, as character classes: xgrammar's own ``any_text`` with
    excludes matches bytes, invalid UTF-8 included, so it would let special tokens through."""
    return {"type": "grammar", "grammar": excluding_grammar(excludes)}


def excluding_grammar(excludes: Sequence[str]) -> str:
    """EBNF for text that contains none of ``excludes``: one rule per state of their Aho-Corasick
    automaton (the longest prefix of an excluded string the text ends with); a state where one
    of them is complete has no rule, so no text reaches it."""
    words = [w for w in excludes if w]
    if not words:
        return "root ::= [\\0-\\U0010ffff]*"
    prefixes = sorted({w[:i] for w in words for i in range(len(w) + 1)}, key=len)
    alphabet = sorted({ch for w in words for ch in w})

    def state(text: str) -> str:  # the longest suffix of ``text`` that is a prefix of a word
        return next(text[i:] for i in range(len(text) + 1) if text[i:] in prefix_set)

    prefix_set = set(prefixes)
    banned = {p for p in prefixes if any(w in p for w in words)}
    names = {p: f"s{i}" if i else "root" for i, p in enumerate(p for p in prefixes if p not in banned)}
    others = "[^" + "".join(_class_char(ch) for ch in alphabet) + "]"
    rules = []
    for prefix, name in names.items():
        moves = ['""', f"{others} root"]
        for ch in alphabet:
            after = state(prefix + ch)
            if after not in banned and not any(w in prefix + ch for w in words):
                moves.append(f"{_ebnf_string(ch)} {names[after]}")
        rules.append(f"{name} ::= " + " | ".join(f"({move})" for move in moves))
    return "\n".join(rules)


def _class_char(ch: str) -> str:
    """``ch`` inside an EBNF character class."""
    if ch in "]\\^-":
        return "\\" + ch
    return ch if " " <= ch <= "~" else f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}"


def _sub_grammar(grammar: xgr.Grammar) -> dict[str, Any]:
    return {"type": "grammar", "grammar": grammar_text(grammar)}


def _ebnf_string(text: str) -> str:
    """``text`` as an EBNF string literal (escapes for quotes, backslashes, non-printables)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
    return '"' + "".join(out) + '"'


def _reason(exc: Exception) -> str:
    return _LOG_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)


def tokenizer_info(vocab: Sequence[bytes]) -> xgr.TokenizerInfo:
    """The vocabulary as xgrammar sees it: b"" tokens count as special (never allowed), and
    ``SPECIAL_BYTES`` tokens are invalid UTF-8 (never text; a structure's token node takes one)."""
    return xgr.TokenizerInfo(list(vocab), xgr.VocabType.RAW, vocab_size=len(vocab))


class XGrammarBackend:
    """One per worker: the vocabulary as xgrammar's TokenizerInfo, and a compiler without its own
    cache (GrammarCache caches compiled grammars)."""

    name = NAME

    def __init__(self, vocab: Sequence[bytes], max_threads: int = 2) -> None:
        self.vocab_size = len(vocab)
        info = tokenizer_info(vocab)
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def compile(self, constraint: StructuredOutput) -> XGrammarCompiled:
        grammar = build_grammar(constraint, self.vocab_size)
        try:
            return XGrammarCompiled(self._compiler.compile_grammar(grammar))
        except RuntimeError as exc:
            raise GrammarError(
                f"the xgrammar backend cannot compile this constraint: {_reason(exc)}"
            ) from None


class XGrammarCompiled:
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled

    def matcher(self, stop_token_ids: Sequence[int]) -> XGrammarMatcher:
        return XGrammarMatcher(self.compiled, stop_token_ids)


class XGrammarMatcher:
    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int]) -> None:
        if not stop_token_ids:
            raise ValueError("a matcher needs at least one stop token id")
        # Stop ids are only ever stops (never text), and allowed exactly where the grammar may end.
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        vocab_size = compiled.tokenizer_info.vocab_size
        # xgrammar sets the bits past the vocabulary in the last word whenever "any text" is allowed
        self._tail_mask = np.uint32((1 << (vocab_size % 32)) - 1) if vocab_size % 32 else None

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._tail_mask is not None:
            bitmask[row].numpy().view(np.uint32)[-1] &= self._tail_mask

    def advance(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        try:
            self._matcher.rollback(num_tokens)
        except RuntimeError as exc:
            raise ValueError(_reason(exc)) from None

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def state_key(self) -> str:
        # xgrammar 0.2.9 exposes its parser state only through this debug print (about 1 us).
        text: str = self._matcher._debug_print_internal_state()
        return _POSITION.sub("", text[text.find("Last step:") :])


def validate(constraint: StructuredOutput) -> None:
    """Raise GrammarError unless the constraint compiles (checked without a vocabulary)."""
    build_grammar(constraint)
