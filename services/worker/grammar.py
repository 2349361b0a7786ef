"""Grammar masks in the worker: compile when a sequence arrives, fill masks while the forward runs.

``Grammars`` owns the backends (built lazily from the model's vocabulary, one per backend name)
and their compile caches. ``SequenceGrammar`` is one sequence's constraint: it waits for
``start_after`` (the end of the reasoning), then advances a matcher with every output token.
``MaskJob`` fills the bitmasks of a step's constrained rows and turns them into additive biases
on a helper thread, started before the forward and joined after it, so the mask work overlaps
the model instead of adding to the step.

Budget: a grammar keeps every prefix valid but cannot make a model stop, so an open-ended schema
(recursion, unbounded strings or numbers) could run out of ``max_tokens`` mid-value. When the
tokens left come close to the length of a way out (``completion_path``), the sequence stops
choosing and walks that way out: the output ends valid, ``STEER_SLACK`` tokens or more early.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from libs.grammar import make_backend
from libs.grammar.backend import CompiledGrammar, GrammarBackend, GrammarError, Matcher
from libs.grammar.cache import GrammarCache
from libs.grammar.completion import Alphabet, completion_path
from libs.kernels.token_mask import bitmask_to_bias
from libs.protocol.codec import unpack_tokens
from libs.protocol.messages import StructuredOutput

log = logging.getLogger(__name__)

DEFAULT_BACKEND = "xgrammar"  # the gateway's default --grammar-backend
# The way out is walked once it needs STEER_SLACK tokens fewer than are left: the most that one
# sampled token (a ',' opening another property, say) may lengthen it between two searches.
STEER_SLACK = 16
RECHECK_STEPS = 8  # steps between searches while the way out is not yet close
HORIZON = 128  # no search while more tokens than this are left beyond the last way out


class Grammars:
    """Backends and compile caches of one worker. ``vocab[i]``: token i's bytes, b"" for a token
    no grammar may produce as text (special tokens, padding past the tokenizer)."""

    def __init__(self, vocab: Sequence[bytes] | None, max_cached: int = 256) -> None:
        self.vocab = vocab
        self.vocab_size = len(vocab) if vocab is not None else 0
        self.max_cached = max_cached
        self.alphabet = Alphabet.of(vocab) if vocab is not None else None  # for ways out
        self._caches: dict[str, GrammarCache] = {}
        self._lock = threading.Lock()  # backends are built on first use, maybe from two threads

    def _cache(self, backend_name: str) -> GrammarCache:
        with self._lock:
            cache = self._caches.get(backend_name)
            if cache is None:
                if self.vocab is None:
                    raise GrammarError("this worker's model has no tokenizer vocabulary for grammars")
                backend: GrammarBackend = make_backend(backend_name, self.vocab)
                cache = self._caches[backend_name] = GrammarCache(backend, max_entries=self.max_cached)
            return cache

    def warm(self, backend_name: str) -> None:
        """Build a backend now (importing xgrammar and indexing the vocabulary take about a
        second), so the first request that needs it does not stall a step. Never raises."""
        try:
            self._cache(backend_name)
        except Exception as exc:
            log.warning("grammar backend %s unavailable: %s", backend_name, exc)

    def submit(self, constraint: StructuredOutput) -> Future[CompiledGrammar]:
        """Start compiling (or find the cached grammar); never raises: errors are in the future."""
        try:
            return self._cache(constraint.backend).submit(constraint)
        except Exception as exc:
            failed: Future[CompiledGrammar] = Future()
            failed.set_exception(exc)
            return failed


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
        self._start_after = unpack_tokens(constraint.start_after)
        self._compiled = compiled
        self._stop_token_ids = list(stop_token_ids)
        self._tail: list[int] = []  # last tokens seen while waiting for start_after
        self.active = not self._start_after  # its tokens are drawn under the grammar's masks
        self._matcher: Matcher | None = None
        self._pending: list[int] = []
        self._alphabet = alphabet  # None: never steered to a way out
        self._way_out: list[int] = []  # being walked: the tokens still to come, then the stop token
        self._way_out_len = 0  # length of the last way out found
        self._since_search = RECHECK_STEPS

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
        if self._way_out:
            # The mask allowed only the way out's next token; anything else is a plan that ran past.
            self._way_out = self._way_out[1:] if token_id == self._way_out[0] else []

    def fill(self, bitmask: torch.Tensor, row: int, remaining: int | None = None) -> None:
        """Write the allowed next tokens into ``bitmask[row]``; ``remaining``: output tokens the
        sequence may still produce, this one included (None: no budget to keep). Raises
        GrammarError if the grammar failed to compile. Joins the compile on first use."""
        matcher = self._matcher
        if matcher is None:
            matcher = self._matcher = self._compiled.result().matcher(self._stop_token_ids)
            for token_id in self._pending:
                _advance(matcher, token_id)
            self._pending.clear()
        if matcher.is_terminated():
            # Only stop tokens: a plan already in flight when the stop token was sampled runs one
            # more step for it (its token is dropped), and a row must never be all -inf.
            _allow_only(bitmask, row, self._stop_token_ids)
            return
        if remaining is not None and self._steer(matcher, remaining):
            _allow_only(bitmask, row, self._way_out[:1])
            return
        matcher.fill_mask(bitmask, row)

    def _steer(self, matcher: Matcher, remaining: int) -> bool:
        """Whether this token must follow the way out (searching for one when it may be close)."""
        if self._way_out or self._alphabet is None:
            return bool(self._way_out)
        self._since_search += 1
        close = remaining <= self._way_out_len + STEER_SLACK + RECHECK_STEPS
        due = self._since_search >= RECHECK_STEPS and remaining <= self._way_out_len + HORIZON
        if not (close or due):
            return False
        self._since_search = 0
        try:
            path = completion_path(matcher, self._alphabet, self._stop_token_ids[0])
        except Exception:  # a backend's rollback refused: go on unsteered rather than fail the row
            log.exception("no way out of the grammar could be searched")
            self._alphabet = None
            return False
        if path is None:  # none within the search's limit (minItems: 1000, say): never steered
            self._alphabet = None
            return False
        self._way_out_len = len(path)
        if len(path) + STEER_SLACK >= remaining:
            self._way_out = path
        return bool(self._way_out)


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


@dataclass(frozen=True, slots=True)
class MaskResult:
    rows: list[int]  # indices into the step's sampled rows
    bias: torch.Tensor | None  # [len(rows), vocab] float32 0 / -inf; None when no row is masked
    failed: dict[int, str]  # sampled-row index -> why its grammar cannot be used


class MaskJob:
    """Fills a step's masks on one helper thread (a thread, not a process: the forward releases the
    GIL in its kernels, and the matchers' state must stay in this process)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    def start(self, grammars: list[tuple[int, SequenceGrammar, int]]) -> Future[MaskResult]:
        """``grammars``: (sampled-row index, its grammar, output tokens it may still produce)."""
        return self._executor.submit(self._build, grammars)

    def _build(self, grammars: list[tuple[int, SequenceGrammar, int]]) -> MaskResult:
        bitmask = torch.empty(len(grammars), (self.vocab_size + 31) // 32, dtype=torch.int32)
        rows: list[int] = []
        failed: dict[int, str] = {}
        for index, grammar, remaining in grammars:
            try:
                grammar.fill(bitmask, len(rows), remaining)
            except Exception as exc:  # a compile error surfaces here, for this sequence only
                failed[index] = f"structured output: {exc}"
                continue
            rows.append(index)
        if not rows:
            return MaskResult([], None, failed)
        return MaskResult(rows, bitmask_to_bias(bitmask[: len(rows)], self.vocab_size), failed)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
