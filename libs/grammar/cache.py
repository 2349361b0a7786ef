"""The worker's compile cache: compiled grammars by ``grammar_key``, compiled off the step loop.

``submit`` starts compiling when a sequence arrives and returns a future the worker joins right
before the sequence's first masked sample; a second submit of the same key while it compiles
gets the same future. Finished grammars stay in an LRU of ``max_entries``; a failed compile's
future carries its GrammarError and nothing is cached, so a later submit tries again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from libs.grammar.backend import CompiledGrammar, GrammarBackend, grammar_key
from libs.protocol.messages import StructuredOutput


class GrammarCache:
    def __init__(self, backend: GrammarBackend, max_entries: int = 256, max_workers: int = 2) -> None:
        self.backend = backend
        self.max_entries = max_entries
        self._entries: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._compiling: dict[str, Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")

    def submit(self, constraint: StructuredOutput) -> Future[CompiledGrammar]:
        key = grammar_key(constraint)
        with self._lock:
            compiled = self._entries.get(key)
            if compiled is not None:
                self._entries.move_to_end(key)
                done: Future[CompiledGrammar] = Future()
                done.set_result(compiled)
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

    def _compile(self, key: str, constraint: StructuredOutput) -> CompiledGrammar:
        try:
            compiled = self.backend.compile(constraint)
        except BaseException:
            with self._lock:
                del self._compiling[key]
            raise
        with self._lock:
            del self._compiling[key]
            self._entries[key] = compiled
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return compiled
