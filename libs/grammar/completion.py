"""A short way to finish: the tokens that take a matcher from where it is to the end of its grammar.

The worker uses it to keep a constrained output inside its ``max_tokens``: when the tokens left
would barely cover the way out, it stops letting the model choose and walks this path, so an
open-ended schema (recursion, unbounded strings or numbers) ends as valid JSON instead of being
cut off mid-value.

Two parts. First the bytes: a depth-first walk over one-byte tokens, tried in an order that
closes before it opens: a stop token, then ``"`` ``}`` ``]``, digits, letters, punctuation,
``,``, and ``[`` ``{`` last. States already seen are skipped, keyed by the backend's
``state_key`` and the number of structural bytes (``"`` ``]`` ``}`` ``,``) on the path: a loop
inside one value (more digits, more characters in a string) revisits a key and is cut, while a
structure that repeats after another (the next array item, a second ``$ref`` to one definition)
gets a new key. Then the tokens: those bytes are spelled with the fewest whole tokens of the
vocabulary (``"}]``, ``": "``, ``</`` rather than one byte each), which is what makes a way out
about as long as the model's own ending. Both backends match bytes, so a token is accepted
exactly when its bytes are one after another; the spelling is still advanced through the real
matcher, and the one-byte path is kept should it refuse. A grammar whose markup is special
tokens (a STRUCTURE's token nodes) passes their ids as ``markup_ids``: the walk tries them before
the bytes, and the spelling keeps them where they are.

It never returns a wrong path (every token is accepted by the real matcher, and the path ends
with an accepted stop token); it may return a longer path than the shortest, or none when
``max_steps`` runs out.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from libs.grammar.backend import SPECIAL_BYTES, Matcher

log = logging.getLogger(__name__)

_FIRST: Final = b'"}]0123456789nft'  # closers, then the shortest values: 0, null, false, true
_LATE: Final = b",\n[{"  # these add to what must be closed
_MARKS: Final = b'"]},'  # a new one of these is a new value or item, not more of the same
# Bytes that open, close or separate structure (JSON, and a hermes tool call's tags). A token
# without any of them is "plain": inside a string it is more of the string, elsewhere part of a
# number or literal, so it lengthens a way out by a token at most (a '-', '.' or 'e' needs a digit).
STRUCTURAL: Final = b'"{}[],:\\<>'
MAX_PIECE_BYTES: Final = 32  # longer tokens are not used to spell a way out (none is structural)


@dataclass(frozen=True, slots=True, eq=False)  # eq=False: hashed by identity, one per vocabulary
class Alphabet:
    """What the search needs of a vocabulary: its one-byte tokens in the order they are tried
    (every byte value that has a token: a string may need any character, a half-written UTF-8
    character its next byte), which of them are structural (``_MARKS``), the bytes of each
    token, every text token by its bytes (to spell a path in whole tokens), and the plain
    tokens (none of ``STRUCTURAL``)."""

    token_ids: tuple[int, ...]
    num_marks: tuple[int, ...]
    byte_of: Mapping[int, int]  # one-byte token id -> its byte
    texts: Sequence[bytes]  # the vocabulary: token id -> its bytes
    pieces: Mapping[bytes, int]  # a text token's bytes -> its id (the lowest, for duplicates)
    plain_ids: tuple[int, ...]

    @classmethod
    def of(cls, vocab: Sequence[bytes]) -> Alphabet:
        by_byte: dict[int, int] = {}
        pieces: dict[bytes, int] = {}
        plain: list[int] = []
        for token_id, text in enumerate(vocab):
            if text == SPECIAL_BYTES:
                continue  # a special token: no text spells it (a grammar names it by id)
            if len(text) == 1:
                by_byte.setdefault(text[0], token_id)
            if text and len(text) <= MAX_PIECE_BYTES:
                pieces.setdefault(text, token_id)
            if text and not any(b in STRUCTURAL for b in text):
                plain.append(token_id)
        middle = [b for b in range(0x20, 0x7F) if b not in _FIRST and b not in _LATE]
        order = dict.fromkeys([*_FIRST, *middle, *_LATE, *range(0x80, 0x100), *range(0x20)])
        token_ids = tuple(by_byte[b] for b in order if b in by_byte)
        marks = tuple(int(vocab[t][0] in _MARKS) for t in token_ids)
        return cls(token_ids, marks, {t: vocab[t][0] for t in token_ids}, vocab, pieces, tuple(plain))


def completion_path(
    matcher: Matcher,
    alphabet: Alphabet,
    stop_token_id: int,
    max_steps: int = 4096,
    max_depth: int = 192,
    markup_ids: Sequence[int] = (),
) -> list[int] | None:
    """Tokens (ending with ``stop_token_id``) that finish the grammar from the matcher's state, or
    None if none was found within ``max_steps`` token trials and ``max_depth`` bytes (a matcher
    may only roll back so far: outlines keeps 256 states). The matcher is left as it was."""
    path = byte_path(matcher, alphabet, stop_token_id, max_steps, max_depth, markup_ids)
    if not path:
        return path
    spelled: list[int] = []
    run: list[int] = []  # one-byte tokens since the last markup token
    for token_id in path[:-1]:
        if token_id in alphabet.byte_of:
            run.append(token_id)
            continue
        spelled += [*whole_tokens(bytes(alphabet.byte_of[t] for t in run), alphabet.pieces), token_id]
        run = []
    spelled += whole_tokens(bytes(alphabet.byte_of[t] for t in run), alphabet.pieces)
    if len(spelled) + 1 < len(path) and accepts(matcher, [*spelled, stop_token_id]):
        return [*spelled, stop_token_id]
    if len(spelled) + 1 < len(path):
        log.warning("a way out in whole tokens was refused; it is walked byte by byte")
    return path


def byte_path(
    matcher: Matcher,
    alphabet: Alphabet,
    stop_token_id: int,
    max_steps: int = 4096,
    max_depth: int = 192,
    markup_ids: Sequence[int] = (),
) -> list[int] | None:
    """``completion_path`` in one-byte tokens (and markup tokens: ``_MarkupOrder``)."""
    if matcher.is_terminated():
        return []
    markup = tuple(t for t in markup_ids if t not in alphabet.byte_of)
    orders = _MarkupOrder(matcher, alphabet, markup) if markup else None
    candidates, marks = alphabet.token_ids, alphabet.num_marks
    path: list[int] = []
    resume: list[int] = []  # per path token: where to go on in ``candidates`` after backtracking
    num_marks: list[int] = [0]  # structural bytes on the path, per depth
    nodes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # with markup: per depth, its order
    seen = {(matcher.state_key(), 0)}
    steps = 0
    index = -1  # -1: try the stop token first
    try:
        while steps < max_steps:
            if index == -1:
                steps += 1
                if matcher.advance(stop_token_id):
                    matcher.rollback(1)
                    return [*path, stop_token_id]
                index = 0
                if orders is not None:
                    steps += 1
                    nodes.append(orders.here())
                    candidates, marks = nodes[-1]
            while index < len(candidates) and len(path) < max_depth:
                token_id, index = candidates[index], index + 1
                steps += 1
                if not matcher.advance(token_id):
                    continue
                key = (matcher.state_key(), num_marks[-1] + marks[index - 1])
                if key in seen:
                    matcher.rollback(1)
                    continue
                seen.add(key)
                path.append(token_id)
                resume.append(index)
                num_marks.append(key[1])
                index = -1
                break
            else:  # every candidate tried: back up one token
                if nodes:
                    nodes.pop()
                if not path:
                    return None
                matcher.rollback(1)
                path.pop()
                num_marks.pop()
                index = resume.pop()
                if nodes:
                    candidates, marks = nodes[-1]
        return None
    finally:
        if path:
            matcher.rollback(len(path))


class _MarkupOrder:
    """The candidates, per state, of a grammar whose markup is tokens (a STRUCTURE's token nodes).

    Only what the state's mask allows is tried (markup syntaxes have long literals, where one
    byte is allowed: a refusal per byte would exhaust the search). ``<`` and ``/`` come first:
    markup closes with ``</`` and a markup token (a raw value, an optional item, the block).
    Where few bytes are allowed, the markup comes next (it is what the syntax wants there);
    where many are (raw text, a JSON string), after ``"``: a markup token that spells text is
    more of a JSON string, which the quote closes first. Markup, ``]`` and ``}`` count as
    structure (so nested JSON values are told apart by depth); a ``"`` does not, being text in a
    raw value, where a loop of any bytes is then cut. Imports torch (for the mask): worker only."""

    FEW = 2  # allowed bytes at most where the markup goes first

    def __init__(self, matcher: Matcher, alphabet: Alphabet, markup: tuple[int, ...]) -> None:
        import torch

        self._matcher = matcher
        self._bitmask = torch.zeros((1, (len(alphabet.texts) + 31) // 32), dtype=torch.int32)
        lead = [t for b in b"</" for t in alphabet.token_ids if alphabet.byte_of[t] == b]
        quote = [t for t in alphabet.token_ids if alphabet.byte_of[t] == ord('"')]
        rest = [t for t in alphabet.token_ids if t not in lead and t not in quote]
        self._orders = ((*lead, *markup, *quote, *rest), (*lead, *quote, *markup, *rest))
        self._marks = frozenset(markup) | {t for t in alphabet.token_ids if alphabet.byte_of[t] in b"]}"}
        self._markup = frozenset(markup)
        self._ids = np.array(self._orders[0], dtype=np.int64)

    def here(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The candidates the matcher's mask allows where it is, in order, and their marks."""
        self._matcher.fill_mask(self._bitmask, 0)
        words = self._bitmask[0].numpy().view(np.uint32)
        bits = (words[self._ids // 32] >> (self._ids % 32).astype(np.uint32)) & 1
        allowed = {t for t, bit in zip(self._orders[0], bits.tolist(), strict=True) if bit}
        few = len(allowed - self._markup) <= self.FEW
        chosen = tuple(t for t in self._orders[0 if few else 1] if t in allowed)
        return chosen, tuple(int(t in self._marks) for t in chosen)


def whole_tokens(data: bytes, pieces: Mapping[bytes, int]) -> list[int]:
    """``data`` spelled with the fewest tokens of ``pieces`` (ties: the longer first token).
    Every byte must have a one-byte token."""
    return _spell(data, 0, _first_pieces(data, pieces), pieces)


def next_steps(
    path: Sequence[int], alphabet: Alphabet, markup_ids: Sequence[int] = ()
) -> dict[int, list[int]]:
    """For each token whose bytes begin the bytes of the way out ``path`` (its first token among
    them, and shorter ones such as ``' "'`` before ``' "",'``): the fewest tokens that finish
    from after it, the stop token last. A model that takes one of them has a way out this long.
    Only text before the path's first markup token is respelled; the path goes on from there."""
    if len(path) <= 1:
        return {}  # the way out is the stop token: no text to begin it
    markup = set(markup_ids)
    cut = next((i for i, t in enumerate(path[:-1]) if t in markup), len(path) - 1)
    if cut == 0:
        return {path[0]: list(path[1:])}
    data = b"".join(alphabet.texts[t] for t in path[:cut])
    rest = list(path[cut:])  # from the first markup token (or the stop token) on
    first = _first_pieces(data, alphabet.pieces)
    steps: dict[int, list[int]] = {}
    for length in range(1, min(MAX_PIECE_BYTES, len(data)) + 1):
        token_id = alphabet.pieces.get(data[:length])
        if token_id is not None:
            steps[token_id] = [*_spell(data, length, first, alphabet.pieces), *rest]
    return steps


def _first_pieces(data: bytes, pieces: Mapping[bytes, int]) -> list[int]:
    """``first[i]``: the length of the first token of a fewest-token spelling of ``data[i:]``,
    by dynamic programming from the end."""
    n = len(data)
    num_tokens = [0] * (n + 1)  # num_tokens[i]: fewest tokens that spell data[i:]
    first = [0] * n
    for i in range(n - 1, -1, -1):
        best = n + 1
        for length in range(min(MAX_PIECE_BYTES, n - i), 0, -1):
            if data[i : i + length] in pieces and num_tokens[i + length] + 1 < best:
                best, first[i] = num_tokens[i + length] + 1, length
        num_tokens[i] = best
    return first


def _spell(data: bytes, start: int, first: Sequence[int], pieces: Mapping[bytes, int]) -> list[int]:
    out: list[int] = []
    i = start
    while i < len(data):
        out.append(pieces[data[i : i + first[i]]])
        i += first[i]
    return out


def accepts(matcher: Matcher, token_ids: Sequence[int]) -> bool:
    """Whether the matcher accepts ``token_ids`` one after another (it is left as it was)."""
    num_accepted = 0
    try:
        for token_id in token_ids:
            if not matcher.advance(token_id):
                return False
            num_accepted += 1
        return True
    finally:
        if num_accepted:
            matcher.rollback(num_accepted)
