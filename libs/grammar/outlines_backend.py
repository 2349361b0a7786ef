"""The outlines backend: a constraint becomes one regular expression (outlines-core translates
schemas), then a token-level DFA index over the vocabulary; a Guide walks it per sequence.

Three workarounds, each found by experiment (tests/unit/grammar):
- Whitespace: outlines puts one whitespace pattern on both sides of every ',' and ':'. We pass a
  sentinel and rewrite it, so JSON comes out as json.dumps (and the xgrammar backend) writes it.
- End of text: outlines-core 0.2.14 drops every transition from an accepting state into a
  non-accepting one ("1" can never grow into "1.5", "a" never into "a b"). So the regex ends with
  an end marker, a NUL byte that only one extra token id (past the vocabulary) spells: no state
  before it accepts, and "the output may end here" means "the marker is allowed". Tokens holding
  a NUL byte are left out of the index (no constraint here can ask for one).
- Stop tokens: outlines knows one eos; the matcher allows its own stop ids where the marker is.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import numpy as np
import outlines_core as oc
from outlines_core.json_schema import build_regex_from_schema

from libs.grammar.backend import SPECIAL_BYTES, GrammarError
from libs.grammar.constraint import load_call_or_format, load_schema
from libs.grammar.schema_check import OUTLINES_MAX_REF_DEPTH
from libs.protocol.messages import StructuredOutput, StructuredOutputKind

if TYPE_CHECKING:
    import torch  # only the bitmask's type: outlines itself needs no torch

NAME: Final = "outlines"
MAX_ROLLBACK: Final = 256  # tokens a matcher can roll back (outlines keeps a bounded state history)
_END: Final = b"\x00"  # the end marker's byte
_WS: Final = "\x00ws\x00"  # whitespace sentinel; schemas holding NUL are rejected, so it is unique
_WS_REWRITES: Final = (
    (_WS + ":" + _WS, ": "),
    (_WS + "," + _WS, ", "),
    (_WS + ",", ", "),  # "item," before an optional group whose own leading sentinel goes
    ("," + _WS, ", "),
    (_WS, ""),  # after '{' / '[', before '}' / ']', before a key
)
_REGEX_META: Final = frozenset("\\.+*?()|[]{}^$#&-~")


def schema_regex(schema: object) -> str:
    """A JSON Schema (already checked and rewritten) as a regex in our JSON style."""
    text = json.dumps(schema)
    if "\\u0000" in text:
        raise GrammarError("the outlines backend cannot produce NUL characters")
    try:
        regex: str = build_regex_from_schema(
            text, whitespace_pattern=_WS, max_recursion_depth=OUTLINES_MAX_REF_DEPTH
        )
    except ValueError as exc:
        raise GrammarError(f"the outlines backend cannot compile this schema: {exc}") from None
    for old, new in _WS_REWRITES:
        regex = regex.replace(old, new)
    return regex


def constraint_regex(constraint: StructuredOutput) -> str:
    """The whole constraint as one regex, end marker included. Raises GrammarError."""
    if constraint.backend != NAME:
        raise GrammarError(f"constraint is for backend {constraint.backend!r}, not {NAME}", param="backend")
    kind = constraint.kind
    if kind == StructuredOutputKind.JSON:
        body = schema_regex({"type": "object"})
    elif kind == StructuredOutputKind.JSON_SCHEMA:
        body = schema_regex(load_schema(constraint.spec, NAME))
    elif kind == StructuredOutputKind.REGEX:
        body = constraint.spec
    elif kind == StructuredOutputKind.TOOL_TRIGGERS:
        raise GrammarError("the outlines backend cannot do tool triggers (use xgrammar)", param="kind")
    elif kind == StructuredOutputKind.STRUCTURE:
        raise GrammarError(
            "the outlines backend cannot match special tokens, which this call syntax needs (use xgrammar)",
            param="kind",
        )
    elif kind == StructuredOutputKind.CALL_OR_FORMAT:
        union = load_call_or_format(constraint.spec, NAME)
        fmt = union.regex if union.regex is not None else schema_regex(union.schema)
        calls = [f"{_escape(t.begin)}(?:{schema_regex(t.schema)}){_escape(t.end)}" for t in union.tags]
        body = "|".join(f"(?:{alternative})" for alternative in (fmt, *calls))
    else:
        raise GrammarError(f"unknown constraint kind {kind!r}", param="kind")
    if "\x00" in constraint.prefix + constraint.suffix:
        raise GrammarError("the outlines backend cannot produce NUL characters")
    return f"{_escape(constraint.prefix)}(?:{body}){_escape(constraint.suffix)}\\x00"


def _escape(text: str) -> str:
    """``text`` as a literal in Rust regex syntax."""
    return "".join(
        "\\" + ch if ch in _REGEX_META else f"\\x{{{ord(ch):x}}}" if ch < " " else ch for ch in text
    )


def build_index(regex: str, vocabulary: oc.Vocabulary) -> oc.Index:
    try:
        return oc.Index(regex, vocabulary)
    except ValueError as exc:
        raise GrammarError(f"the outlines backend cannot compile this constraint: {exc}") from None


def make_vocabulary(vocab: Sequence[bytes]) -> oc.Vocabulary:
    """outlines' Vocabulary: every text token without a NUL (special tokens are not text), the end
    marker at id len(vocab), and an eos (len(vocab) + 1) that is never used."""
    tokens: dict[bytes, list[int]] = {}
    for token_id, text in enumerate(vocab):
        if text and _END not in text and text != SPECIAL_BYTES:
            tokens.setdefault(text, []).append(token_id)
    tokens[_END] = [len(vocab)]
    return oc.Vocabulary(len(vocab) + 1, tokens)


@functools.cache
def _byte_vocabulary() -> oc.Vocabulary:
    return make_vocabulary([bytes([b]) for b in range(256)])


def validate(constraint: StructuredOutput) -> None:
    """Raise GrammarError unless the constraint compiles (indexed over a one-byte-per-token vocabulary)."""
    build_index(constraint_regex(constraint), _byte_vocabulary())


class OutlinesBackend:
    name = NAME

    def __init__(self, vocab: Sequence[bytes]) -> None:
        self.vocab_size = len(vocab)
        self._vocabulary = make_vocabulary(vocab)

    def compile(self, constraint: StructuredOutput) -> OutlinesCompiled:
        return OutlinesCompiled(build_index(constraint_regex(constraint), self._vocabulary), self.vocab_size)


class OutlinesCompiled:
    def __init__(self, index: oc.Index, vocab_size: int) -> None:
        self.index = index
        self.vocab_size = vocab_size

    def matcher(self, stop_token_ids: Sequence[int]) -> OutlinesMatcher:
        return OutlinesMatcher(self.index, self.vocab_size, stop_token_ids)


class OutlinesMatcher:
    def __init__(self, index: oc.Index, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        stops = sorted({t for t in stop_token_ids if 0 <= t < vocab_size})
        if not stops:
            raise ValueError("a matcher needs at least one stop token id")
        self._guide = oc.Guide(index, max_rollback=MAX_ROLLBACK)
        self._vocab_size = vocab_size
        self._stops = frozenset(stops)
        self._stop_bits = [(t // 32, np.uint32(1 << (t % 32))) for t in stops]
        self._num_words = (vocab_size + 31) // 32
        # Room for the end marker's and eos's bits past the vocabulary.
        self._scratch = np.zeros((vocab_size + 2 + 31) // 32, dtype=np.uint32)
        self._tail_mask = np.uint32((1 << (vocab_size % 32)) - 1) if vocab_size % 32 else None
        self._history: list[bool] = []  # per accepted token: was it a stop token
        self._terminated = False

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        scratch = self._scratch
        self._guide.write_mask_into(scratch.ctypes.data, scratch.size, 4)
        words = bitmask[row].numpy().view(np.uint32)  # [num_words], a view: written in place
        words[:] = scratch[: self._num_words]
        if self._tail_mask is not None:
            words[-1] &= self._tail_mask
        may_end = (int(scratch[self._vocab_size // 32]) >> (self._vocab_size % 32)) & 1
        for word, bit in self._stop_bits:
            if may_end:
                words[word] |= bit
            else:
                words[word] &= ~bit

    def advance(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self._stops:
            if not self._guide.accepts_tokens([self._vocab_size]):  # the end marker
                return False
            self._terminated = True
            self._history.append(True)
            return True
        if not 0 <= token_id < self._vocab_size:
            return False
        try:
            self._guide.advance(token_id, return_tokens=False)
        except ValueError:
            return False
        self._history.append(False)
        return True

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {len(self._history)} accepted")
        undone = self._history[len(self._history) - num_tokens :]
        num_steps = undone.count(False)
        if num_steps > self._guide.get_allowed_rollback():
            raise ValueError(f"cannot roll back more than {MAX_ROLLBACK} tokens")
        self._guide.rollback_state(num_steps)
        del self._history[len(self._history) - num_tokens :]
        self._terminated = self._terminated and True not in undone

    def is_terminated(self) -> bool:
        return self._terminated

    def state_key(self) -> tuple[int, bool]:
        return self._guide.get_state(), self._terminated  # a DFA state: exact
