"""The worker's compile cache: compiled grammars by ``grammar_key``, compiled off the step loop.

``submit`` starts compiling when a sequence arrives and returns a future the worker joins right
before the sequence's first masked sample; a second submit of the same key while it compiles
gets the same future. Finished compiles stay in an LRU of ``max_entries``, failures included: a
GrammarError (an invalid constraint) is the constraint's own, so a repeat fails at once instead of
burning another compile. One past a compile bound (GrammarLimitError) is remembered for
``limit_memory_s`` only: under load a fair grammar may pass the time bound once. Other failures
(BackendUnavailable, a bug) are not cached: a later submit tries again.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from libs.grammar.backend import (
    BackendUnavailable,
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarLimitError,
    grammar_key,
)
from libs.protocol.messages import StructuredOutput


class GrammarCache:
    def __init__(
        self,
        backend: GrammarBackend,
        max_entries: int = 256,
        max_workers: int = 2,
        on_error: Callable[[GrammarError], None] | None = None,
        limit_memory_s: float = 60.0,
    ) -> None:
        """``on_error``: told of each compile that failed (once per compile, not per repeat)."""
        self.backend = backend
        self._on_error = on_error
        self.limit_memory_s = limit_memory_s
        self._expires: dict[str, float] = {}  # key -> when its remembered GrammarLimitError goes
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()  # each one done
        self._compiling: dict[str, Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")

    def submit(self, constraint: StructuredOutput) -> Future[CompiledGrammar]:
        key = grammar_key(constraint)
        with self._lock:
            done = self._entries.get(key)
            if done is not None and self._expires.get(key, float("inf")) < time.monotonic():
                del self._entries[key], self._expires[key]
                done = None
            if done is not None:
                self._entries.move_to_end(key)
                return done
            future = self._compiling.get(key)
            if future is None:
                future = self._compiling[key] = self._pool.submit(self._compile, key, constraint)
            return future

    def get(self, constraint: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar, compiling it if needed (blocks). Raises GrammarError."""
        return self.submit(constraint).result()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, constraint: StructuredOutput) -> bool:
        with self._lock:
            return grammar_key(constraint) in self._entries

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        close = getattr(self.backend, "close", None)
        if close is not None:  # a sandboxed backend's compiler processes
            close()

    def _compile(self, key: str, constraint: StructuredOutput) -> CompiledGrammar:
        done: Future[CompiledGrammar] = Future()
        try:
            compiled = self.backend.compile(constraint)
        except GrammarError as exc:
            if not isinstance(exc, BackendUnavailable):
                done.set_exception(exc)
            if self._on_error is not None:
                self._on_error(exc)
            raise
        else:
            done.set_result(compiled)
            return compiled
        finally:
            with self._lock:
                del self._compiling[key]
                if done.done():
                    self._entries[key] = done
                    if isinstance(done.exception(), GrammarLimitError):
                        self._expires[key] = time.monotonic() + self.limit_memory_s
                    while len(self._entries) > self.max_entries:
                        evicted, _ = self._entries.popitem(last=False)
                        self._expires.pop(evicted, None)
