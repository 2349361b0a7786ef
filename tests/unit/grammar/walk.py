"""Random walks through a grammar matcher: each step draws only tokens its mask allows.

A uniform draw over a 49k vocabulary almost never closes an unbounded string, so after
``finish_after`` steps the walk is steered to finish: it stops as soon as a stop token is
allowed, else prefers tokens that close something (``"``, ``]``, ``}``) and open nothing, then
the shortest.
Tokens that are not whole UTF-8 on their own (lone byte tokens, pieces of a character) are only
drawn when nothing else is allowed: xgrammar lets byte tokens spell surrogates and overlong
forms (see the report in tests/unit/grammar/test_keyword_tables.py), which no model writes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from libs.grammar.backend import Matcher


@dataclass(frozen=True)
class WalkVocab:
    tokens: Sequence[bytes]
    whole: np.ndarray  # bool [vocab]: decodes as UTF-8 on its own
    closing: np.ndarray  # bool [vocab]: holds '"', ']' or '}' and no '{' or '['
    length: np.ndarray  # int [vocab]: bytes

    @classmethod
    def of(cls, tokens: Sequence[bytes]) -> WalkVocab:
        whole = np.array([_is_whole(t) for t in tokens])
        closing = np.array([_closes(t) for t in tokens])
        return cls(tokens, whole, closing, np.array([len(t) for t in tokens]))

    def text(self, token_ids: Sequence[int], stop_ids: Sequence[int] = ()) -> str:
        return b"".join(self.tokens[t] for t in token_ids if t not in stop_ids).decode("utf-8")


def _closes(token: bytes) -> bool:
    return any(c in token for c in b'"]}') and not any(c in token for c in b"{[")


def _is_whole(token: bytes) -> bool:
    try:
        token.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return bool(token)


def new_bitmask(vocab_size: int, num_rows: int = 1) -> torch.Tensor:
    return torch.zeros(num_rows, (vocab_size + 31) // 32, dtype=torch.int32)


def allowed_ids(bitmask: torch.Tensor, row: int = 0) -> np.ndarray:
    """Token ids whose bit is set in ``bitmask[row]`` (bit t % 32 of word t // 32)."""
    words = bitmask[row].numpy()  # int32 [words], little-endian: byte k of word w holds ids 32w+8k..
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))


def walk(
    matcher: Matcher,
    vocab: WalkVocab,
    stop_ids: Sequence[int],
    rng: random.Random,
    finish_after: int = 40,
    max_steps: int = 600,
) -> list[int]:
    """Accepted token ids, ending with the stop token that terminated the matcher."""
    bitmask = new_bitmask(len(vocab.tokens))
    stops = np.array(list(stop_ids))
    out: list[int] = []
    for step in range(max_steps):
        matcher.fill_mask(bitmask, 0)
        allowed = allowed_ids(bitmask)
        assert len(allowed), f"empty mask after {vocab.text(out)!r}"
        is_stop = np.isin(allowed, stops)
        stop_allowed, others = allowed[is_stop], allowed[~is_stop]
        if len(stop_allowed) and (not len(others) or step >= finish_after or rng.random() < 0.05):
            token = int(stop_allowed[rng.randrange(len(stop_allowed))])
        else:
            token = _draw(others, vocab, rng, steer=step >= finish_after)
        assert matcher.advance(token), f"matcher rejected allowed token {token} after {vocab.text(out)!r}"
        out.append(token)
        if token in stop_ids:
            assert matcher.is_terminated()
            return out
    raise AssertionError(f"walk did not finish in {max_steps} steps: {vocab.text(out)[:200]!r}")


def _draw(candidates: np.ndarray, vocab: WalkVocab, rng: random.Random, steer: bool) -> int:
    whole = candidates[vocab.whole[candidates]]
    if len(whole):
        candidates = whole
    if steer:
        closing = candidates[vocab.closing[candidates]]
        if len(closing):
            candidates = closing
        lengths = vocab.length[candidates]
        candidates = candidates[lengths == lengths.min()]
    return int(candidates[rng.randrange(len(candidates))])


def assert_json_style(text: str) -> None:
    """No whitespace outside strings but one space after each ',' and ':' (json.dumps style)."""
    in_string = escaped = False
    previous = ""
    for ch in text:
        if in_string:
            in_string = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
            continue
        if previous in (",", ":") and ch != " ":
            raise AssertionError(f"no space after {previous!r} in {text!r}")
        if ch.isspace() and (ch != " " or previous not in (",", ":")):
            raise AssertionError(f"free whitespace in {text!r}")
        in_string = ch == '"'
        previous = ch
    json.loads(text)
