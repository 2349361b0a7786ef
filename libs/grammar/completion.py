"""A short way to finish: the tokens that take a matcher from where it is to the end of its grammar.

The worker uses it to keep a constrained output inside its ``max_tokens``: when the tokens left
would barely cover the way out, it stops letting the model choose and walks this path, so an
open-ended schema (recursion, unbounded strings or numbers) ends as valid JSON instead of being
cut off mid-value.

The search is a depth-first walk over one-byte tokens, tried in an order that closes before it
opens: a stop token, then ``"`` ``}`` ``]``, digits, letters, punctuation, ``,``, and ``[`` ``{``
last. It never returns a wrong path (every token is accepted by the real matcher, and the path
ends with an accepted stop token); it may return a longer path than the shortest, or none when
``max_steps`` runs out. States already seen are skipped, keyed by the backend's ``state_key``
and the number of structural bytes (``"`` ``]`` ``}`` ``,``) on the path: a loop inside one value
(more digits, more characters in a string) revisits a key and is cut, while a structure that
repeats after another (the next array item, a second ``$ref`` to one definition) gets a new key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from libs.grammar.backend import Matcher

_FIRST: Final = b'"}]0123456789nft'  # closers, then the shortest values: 0, null, false, true
_LATE: Final = b",\n[{"  # these add to what must be closed
_MARKS: Final = b'"]},'  # a new one of these is a new value or item, not more of the same


@dataclass(frozen=True, slots=True)
class Alphabet:
    """The one-byte tokens of a vocabulary in the order the search tries them (every byte value
    that has a token: a string may need any character, a half-written UTF-8 character its next
    byte), and which are structural bytes (``_MARKS``)."""

    token_ids: tuple[int, ...]
    num_marks: tuple[int, ...]

    @classmethod
    def of(cls, vocab: Sequence[bytes]) -> Alphabet:
        by_byte: dict[int, int] = {}
        for token_id, text in enumerate(vocab):
            if len(text) == 1:
                by_byte.setdefault(text[0], token_id)
        middle = [b for b in range(0x20, 0x7F) if b not in _FIRST and b not in _LATE]
        order = dict.fromkeys([*_FIRST, *middle, *_LATE, *range(0x80, 0x100), *range(0x20)])
        token_ids = tuple(by_byte[b] for b in order if b in by_byte)
        return cls(token_ids, tuple(int(vocab[t][0] in _MARKS) for t in token_ids))


def completion_path(
    matcher: Matcher,
    alphabet: Alphabet,
    stop_token_id: int,
    max_steps: int = 4096,
    max_depth: int = 192,
) -> list[int] | None:
    """Tokens (ending with ``stop_token_id``) that finish the grammar from the matcher's state, or
    None if none was found within ``max_steps`` token trials and ``max_depth`` tokens (a matcher
    may only roll back so far: outlines keeps 256 states). The matcher is left as it was."""
    if matcher.is_terminated():
        return []
    candidates, marks = alphabet.token_ids, alphabet.num_marks
    path: list[int] = []
    resume: list[int] = []  # per path token: where to go on in ``candidates`` after backtracking
    num_marks: list[int] = [0]  # structural bytes on the path, per depth
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
                if not path:
                    return None
                matcher.rollback(1)
                path.pop()
                num_marks.pop()
                index = resume.pop()
        return None
    finally:
        if path:
            matcher.rollback(len(path))
