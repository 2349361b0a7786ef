"""Grammar masks in the worker: compile when a sequence arrives, fill masks while the forward runs.

``Grammars`` (services/worker/grammar_compilers.py) owns the backends and their compile caches.
``SequenceGrammar`` is one sequence's constraint: it waits for
``start_after`` (the end of the reasoning), then advances a matcher with every output token.
``MaskJob`` (services/worker/mask_job.py) fills them on a helper thread while the forward runs.

Speculative decoding: a drafted row samples at each drafted position, so each needs the mask the
grammar would give after the drafts before it. ``num_usable`` cuts a draft, before the step, to
what the grammar accepts in a row; ``fill_drafted`` advances the matcher through it, one mask per
position, then rolls it back; the tokens the step keeps are accepted afterwards, as ever. Only a
sequence whose way out is far (no position could be steered: steering counts its steps, which a
draft would skip) drafts; near its end it decodes one token a step, as without speculation.

Budget: a grammar keeps every prefix valid but cannot make a model stop, so an open-ended schema
(recursion, unbounded strings or numbers) could run out of ``max_tokens`` mid-value. Once the
tokens left come within ``HORIZON`` of a way out (``completion_path``, in whole tokens), the
sequence searches one every few steps, then every step; its margin is the tokens left beyond it.
While the margin is above ``OPEN_SLACK`` the model chooses freely. At ``OPEN_SLACK`` or less it
may no longer add structure (a token that opens an item, an object or a property lengthens the
way out by as much as that item's shortest form: ``}, {"`` in an array of objects with required
properties adds a dozen): only plain tokens and those that begin the way out. At ``STEER_SLACK``
or less it is guarded: it may still write plain tokens (more of a string, a number's digits: a plain token
lengthens the way out by one at most) and the tokens that begin the way out, never other
structure; where the grammar allows few plain tokens (an enum's values) each is checked, so the
model keeps its own choice to the last token. With a margin under two and many plain tokens, only
what begins the way out is left. So an output whose way out fits when the guard begins always
ends valid, and a model that leaves ``STEER_SLACK`` tokens of its budget unused is never steered.
A grammar that may end where it is (free text with tool-call triggers) guards earlier, as many
tokens ahead as its longest call takes: a call the model opens must fit.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np
import torch

from libs.grammar.backend import (
    CompiledGrammar,
    GrammarError,
    Matcher,
)
from libs.grammar.completion import Alphabet, accepts, completion_path, next_steps, whole_tokens
from libs.grammar.constraint import load_tool_triggers
from libs.grammar.structure import Token, load_structure, token_ids, triggers
from libs.protocol.codec import unpack_tokens
from libs.protocol.messages import StructuredOutput, StructuredOutputKind

log = logging.getLogger(__name__)

# The margin (tokens left beyond the way out) at which the model's structural tokens become the
# way out's; above it the model chooses freely, so it is the most that one free token (a '{"'
# opening an object, a ', "' opening a property) may lengthen the way out between two searches.
STEER_SLACK = 8
# The margin at which tokens that add structure stop being free: more than the most one free token
# is expected to add (an item of an array of small objects; a deeper one is a heuristic's miss).
OPEN_SLACK = 24
MAX_GROWTH = 4  # what a free token is taken to add to the way out, to space the searches
RECHECK_STEPS = 8  # the most steps between searches while the way out is not yet close
HORIZON = 128  # no search while more tokens than this are left beyond the last way out
MAX_CHECKED = 16  # a guarded mask with this many plain tokens or fewer checks each of them


class SequenceGrammar:
    """One sequence's constraint. Before ``start_after`` has appeared in the output the sequence
    samples freely; from the next token on every token goes through the matcher.

    Tokens accepted before the compiled grammar is needed wait in ``_pending``: the matcher is
    made (and they are replayed) on the first mask fill, so compiling overlaps the prefill.
    """

    def __init__(
        self,
        constraint: StructuredOutput,
        compiled: Future[CompiledGrammar],
        stop_token_ids: Sequence[int],
        alphabet: Alphabet | None = None,
    ) -> None:
        self._constraint = constraint
        self._start_after = unpack_tokens(constraint.start_after)
        self._compiled = compiled
        self._stop_token_ids = list(stop_token_ids)
        self._tail: list[int] = []  # last tokens seen while waiting for start_after
        self.active = not self._start_after  # its tokens are drawn under the grammar's masks
        self._matcher: Matcher | None = None
        self._pending: list[int] = []
        self._alphabet = alphabet  # None: never steered to a way out
        self._way_out: list[int] = []  # being walked: the tokens still to come, then the stop token
        self._plan: list[int] = []  # a way out from here, known from the last search (or empty)
        self._next: dict[int, list[int]] = {}  # next token -> a way out after it (``next_steps``)
        self._way_out_len = 0  # length of the last way out found
        self._wait = 0  # steps to go before the next search
        self._strict = False  # the last guard: STEER_SLACK (checked) or only OPEN_SLACK (no new structure)
        self._call_cost: int | None = None  # tokens the longest tool call takes (None: not yet known)
        self._markup_ids: tuple[int, ...] | None = None  # a STRUCTURE's token nodes (None: not yet read)

    def accept(self, token_id: int) -> None:
        """Feed one sampled (or replayed) output token."""
        if not self.active:
            self._tail = [*self._tail, token_id][-len(self._start_after) :]
            self.active = self._tail == self._start_after
            return
        if self._matcher is None:
            self._pending.append(token_id)
            return
        _advance(self._matcher, token_id)
        # A token that begins the last way out leaves a known way out; any other voids it.
        self._plan, self._next = self._next.get(token_id, []), {}
        if self._way_out:
            # The mask allowed only the way out's next token; anything else is a plan that ran past.
            self._way_out = self._way_out[1:] if token_id == self._way_out[0] else []

    def num_usable(self, draft: Sequence[int], remaining: int) -> int:
        """How many of ``draft``'s first tokens a step may verify (``remaining``: output tokens
        the sequence may still produce, its next one included). Before ``start_after``: up to the
        token that would complete it (masks start after it). Under the grammar: none until it is
        compiled, or while a way out is walked or may be steered to at any verified position;
        else up to the first token it refuses, or a stop token (included)."""
        if not self.active:
            tail = self._tail
            for i, token_id in enumerate(draft):
                tail = [*tail, token_id][-len(self._start_after) :]
                if tail == self._start_after:
                    return i
            return len(draft)
        if self._matcher is None and not (self._compiled.done() and self._compiled.exception() is None):
            return 0
        matcher = self._ready_matcher()
        if self._way_out or matcher.is_terminated():
            return 0
        if self._alphabet is not None:  # each verified position's fill must be far from steering
            draft = draft[: max(0, remaining - self._way_out_len - HORIZON - 1)]
        num_advanced = 0
        try:
            for token_id in draft:
                if matcher.is_terminated() or not matcher.advance(token_id):
                    break
                num_advanced += 1
        finally:
            matcher.rollback(num_advanced)
        return num_advanced

    def fill_drafted(self, bitmask: torch.Tensor, row: int, remaining: int, draft: Sequence[int]) -> None:
        """``fill`` for a drafted row (``draft`` cut by ``num_usable``): rows ``row .. row +
        len(draft)`` of ``bitmask`` get the masks after 0 .. len(draft) of its tokens; the matcher
        ends where it began."""
        self.fill(bitmask, row, remaining)
        matcher = self._ready_matcher()
        num_advanced = 0
        try:
            for i, token_id in enumerate(draft, start=1):
                if not matcher.advance(token_id):
                    raise GrammarError(f"a draft checked by num_usable was refused at token {token_id}")
                num_advanced += 1
                self.fill(bitmask, row + i, remaining - i)
        finally:
            matcher.rollback(num_advanced)

    def _ready_matcher(self) -> Matcher:
        """The matcher, made on first use (joining the compile; raises GrammarError if it failed)."""
        if self._matcher is None:
            self._matcher = self._compiled.result().matcher(self._stop_token_ids)
            for token_id in self._pending:
                _advance(self._matcher, token_id)
            self._pending.clear()
        return self._matcher

    def fill(self, bitmask: torch.Tensor, row: int, remaining: int | None = None) -> None:
        """Write the allowed next tokens into ``bitmask[row]``; ``remaining``: output tokens the
        sequence may still produce, this one included (None: no budget to keep). Raises
        GrammarError if the grammar failed to compile. Joins the compile on first use."""
        matcher = self._ready_matcher()
        if matcher.is_terminated():
            # Only stop tokens: a plan already in flight when the stop token was sampled runs one
            # more step for it (its token is dropped), and a row must never be all -inf.
            _allow_only(bitmask, row, self._stop_token_ids)
            return
        guard = self._steer(matcher, remaining) if remaining is not None else None
        if self._way_out:
            _allow_only(bitmask, row, self._way_out[:1])
            return
        matcher.fill_mask(bitmask, row)
        if guard is not None and remaining is not None:
            self._guard(matcher, bitmask, row, guard, remaining)

    def _guard(
        self, matcher: Matcher, bitmask: torch.Tensor, row: int, keep: list[int], remaining: int
    ) -> None:
        """Narrows ``bitmask[row]`` to ``keep``, the stop tokens it allows and plain tokens: each
        one checked (a way out after it must fit) when the grammar allows few, else all of them
        while the margin absorbs the one token a plain token may add to the way out."""
        assert self._alphabet is not None
        plain = _plain_mask(self._alphabet, bitmask.shape[1])
        keep = [*keep, *(t for t in self._stop_token_ids if int(bitmask[row, t // 32]) & _bit(t))]
        candidates = _set_bits(bitmask[row] & plain) if self._strict else []
        if self._strict and len(candidates) <= MAX_CHECKED:
            for token_id in candidates:
                rest = self._way_out_after(matcher, token_id)
                if rest is not None and len(rest) < remaining:
                    keep.append(token_id)
                    self._next[token_id] = rest
            _allow_only(bitmask, row, keep)
            return
        if self._strict and remaining - self._way_out_len < 2:
            _allow_only(bitmask, row, keep)
            return
        bitmask[row] &= plain
        for token_id in self._markup():  # markup text may look plain, but opens structure
            bitmask[row, token_id // 32] &= ~_bit(token_id)
        for token_id in keep:
            bitmask[row, token_id // 32] |= _bit(token_id)

    def _way_out_after(self, matcher: Matcher, token_id: int) -> list[int] | None:
        assert self._alphabet is not None
        if not matcher.advance(token_id):
            return None
        try:
            return self._search(matcher, self._alphabet)
        finally:
            matcher.rollback(1)

    def _steer(self, matcher: Matcher, remaining: int) -> list[int] | None:
        """Searches a way out when one may be close. Walks it (``_way_out``) when it no longer fits;
        returns the structural tokens the model may take when it is to be guarded (those that
        begin the way out and leave one that fits); else None."""
        if self._way_out or self._alphabet is None:
            return None
        if remaining > self._way_out_len + HORIZON:
            return None
        if self._wait > 0:
            self._wait -= 1
            return None
        path = self._search(matcher, self._alphabet)
        if path is None:  # none within the search's limit (minItems: 1000, say): never steered
            self._alphabet = None
            return None
        if self._plan and len(self._plan) < len(path) and accepts(matcher, self._plan):
            path = self._plan  # the search is a heuristic: the way out the model followed may be shorter
        self._next = next_steps(path, self._alphabet, self._markup())
        self._way_out_len = len(path)
        margin = remaining - len(path)
        if margin < 0:  # too late to fit: finish as soon as can be
            self._way_out = path
            return None
        slack = STEER_SLACK
        if len(path) == 1:  # the grammar may end here: a tool call opened now must fit
            slack = max(slack, self._tool_call_cost(self._alphabet))
        # Where it may end now, nothing but a call adds to the way out (text goes on freely).
        open_slack = slack if len(path) == 1 else max(OPEN_SLACK, slack)
        # Until the next search each free token takes up to 1 + MAX_GROWTH of the margin.
        self._wait = min(RECHECK_STEPS, max(0, margin - open_slack - 1) // (1 + MAX_GROWTH))
        if margin > open_slack:
            return None
        self._strict = margin <= slack
        # The way out's first token always: it is what makes a row never empty.
        return [path[0], *(t for t, rest in self._next.items() if len(rest) < remaining and t != path[0])]

    def _search(self, matcher: Matcher, alphabet: Alphabet) -> list[int] | None:
        try:
            return completion_path(matcher, alphabet, self._stop_token_ids[0], markup_ids=self._markup())
        except Exception:  # a backend's rollback refused: go on unsteered rather than fail the row
            log.exception("no way out of the grammar could be searched")
            return None

    def _markup(self) -> tuple[int, ...]:
        """The token ids a STRUCTURE names (its markup); () for other constraints."""
        if self._markup_ids is None:
            self._markup_ids = ()
            if self._constraint.kind == StructuredOutputKind.STRUCTURE:
                structure = load_structure(self._constraint.spec, self._constraint.backend)
                self._markup_ids = tuple(sorted(token_ids(structure)))
        return self._markup_ids

    def _openings(self, alphabet: Alphabet) -> list[list[int]]:
        """The tokens that open each tool call the constraint may start in free text."""
        constraint = self._constraint
        if constraint.kind == StructuredOutputKind.TOOL_TRIGGERS:
            tags = load_tool_triggers(constraint.spec, constraint.backend).tags
            return [whole_tokens(tag.begin.encode(), alphabet.pieces) for tag in tags]
        if constraint.kind == StructuredOutputKind.STRUCTURE:
            structure = load_structure(constraint.spec, constraint.backend)
            return [
                [t.token_id] if isinstance(t, Token) else whole_tokens(t.text.encode(), alphabet.pieces)
                for t in triggers(structure)
            ]
        return []

    def _tool_call_cost(self, alphabet: Alphabet) -> int:
        """Tokens from the start of a tool call (its trigger) to the end of the output, for the
        longest of the constraint's tags (0 for a constraint without triggers). Found once, on a
        fresh matcher: each tag's opening text in whole tokens, then a way out from there."""
        if self._call_cost is None:
            self._call_cost = 0
            for opening in self._openings(alphabet):
                probe = self._compiled.result().matcher(self._stop_token_ids)
                if not all(probe.advance(t) for t in opening):
                    continue
                path = self._search(probe, alphabet)
                if path is not None:
                    self._call_cost = max(self._call_cost, len(opening) + len(path))
        return self._call_cost


def _set_bits(words: torch.Tensor) -> list[int]:
    """The token ids whose bits are set in one bitmask row (int32 words)."""
    bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")
    return [int(t) for t in np.flatnonzero(bits)]


@functools.lru_cache(maxsize=4)
def _plain_mask(alphabet: Alphabet, num_words: int) -> torch.Tensor:
    """The plain tokens (``Alphabet.plain_ids``) as one bitmask row of ``num_words`` words."""
    bits = torch.zeros(num_words * 32, dtype=torch.bool)
    bits[list(alphabet.plain_ids)] = True
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    words = (bits.view(num_words, 32).to(torch.int64) * weights).sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _allow_only(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    bitmask[row].zero_()
    for token_id in token_ids:
        bitmask[row, token_id // 32] |= _bit(token_id)


def _advance(matcher: Matcher, token_id: int) -> None:
    if matcher.is_terminated():
        return  # a plan in flight ran past the stop token; the scheduler drops what follows
    if not matcher.advance(token_id):
        # Sampling only draws allowed tokens, so this is a bug; the next mask still holds.
        log.error("grammar rejected token %d", token_id)


def _bit(token_id: int) -> int:
    """Bit ``token_id % 32`` as a signed int32 value (bit 31 is the sign bit)."""
    bit = 1 << (token_id % 32)
    return bit - (1 << 32) if bit >= 1 << 31 else bit
