"""The worker's grammar backends and their compile caches (``Grammars``): built lazily from the
model's vocabulary, one per backend name, compiling in bounded child processes
(libs/grammar/sandbox.py). One sequence's constraint is services/worker/grammar.py's
``SequenceGrammar``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

from libs.grammar import backend_problem
from libs.grammar.backend import BackendUnavailable, CompiledGrammar, GrammarError, GrammarLimitError
from libs.grammar.cache import GrammarCache
from libs.grammar.completion import Alphabet
from libs.grammar.sandbox import CompileLimits, SandboxedBackend, sandboxed_backend
from libs.protocol.messages import StructuredOutput, StructuredOutputKind
from services.worker import metrics

log = logging.getLogger(__name__)

DEFAULT_BACKEND = "xgrammar"  # the gateway's default --grammar-backend


class Grammars:
    """Backends and compile caches of one worker. ``vocab[i]``: token i's bytes as
    ``libs.grammar.grammar_vocab`` spells them (special tokens: never text, reached by id only).

    Compiles run in child processes bounded by ``limits`` (libs.grammar.sandbox): one past a
    bound fails its sequence alone, and is remembered as failed. A constraint whose backend does
    not import here fails its sequence with BackendUnavailable."""

    def __init__(
        self, vocab: Sequence[bytes] | None, max_cached: int = 256, limits: CompileLimits | None = None
    ) -> None:
        self.vocab = vocab
        self.vocab_size = len(vocab) if vocab is not None else 0
        self.max_cached = max_cached
        self.limits = limits if limits is not None else CompileLimits()
        self.alphabet = Alphabet.of(vocab) if vocab is not None else None  # for ways out
        self._caches: dict[str, GrammarCache] = {}
        self._lock = threading.Lock()  # backends are built on first use, maybe from two threads
        self._warming: tuple[SandboxedBackend, Future[CompiledGrammar]] | None = None  # warm()'s

    def _cache(self, backend_name: str) -> GrammarCache:
        with self._lock:
            cache = self._caches.get(backend_name)
            if cache is None:
                if self.vocab is None:
                    raise GrammarError("this worker's model has no tokenizer vocabulary for grammars")
                problem = backend_problem(backend_name)  # the matchers run here: it must import
                if problem is not None:
                    raise BackendUnavailable(f"grammar backend {backend_name} is unavailable: {problem}")
                backend = sandboxed_backend(backend_name, self.vocab, self.limits)
                cache = self._caches[backend_name] = GrammarCache(
                    backend, self.max_cached, self.limits.num_procs, _count_limit_errors
                )
            return cache

    def warm(self, backend_name: str) -> None:
        """Start a backend's compiler processes now (importing xgrammar and indexing the
        vocabulary take seconds) and compile one grammar on them in the background, so the first
        request that needs it does not stall a step (``wait_warm`` waits for both). Never raises."""
        try:
            cache = self._cache(backend_name)
            assert isinstance(cache.backend, SandboxedBackend)
            cache.backend.start(wait=False)
        except Exception as exc:
            log.warning("grammar backend %s unavailable: %s", backend_name, exc)
            return
        warm = cache.submit(StructuredOutput(StructuredOutputKind.JSON, backend=backend_name))
        self._warming = (cache.backend, warm)

        def report(done: Future[CompiledGrammar]) -> None:
            if done.exception() is not None:
                log.warning("grammar backend %s unavailable: %s", backend_name, done.exception())

        warm.add_done_callback(report)

    def wait_warm(self) -> None:
        """Until ``warm``'s processes are all ready and its compile is done (at most their start
        and compile bounds). Their start-up takes seconds of both cores: a worker that announced
        itself before it ends serves its first requests at a fraction of its speed (one stream
        116-141 tok/s against 163 once they were ready, on 2 cores). Never raises: a backend that
        failed to start is each constrained request's error, as before."""
        if self._warming is None:
            return
        backend, warm = self._warming
        try:
            warm.result(self.limits.start_timeout_s + self.limits.timeout_s)
        except Exception:  # warm's callback logged it; the backend's requests will say so
            return
        try:
            backend.start(wait=True)  # every process, not only the one that compiled
        except Exception as exc:
            log.warning("grammar backend %s unavailable: %s", backend.name, exc)

    def compilers_ready(self) -> dict[str, int]:
        """Per backend started here, its compiler processes ready to compile (for /metrics)."""
        with self._lock:
            caches = dict(self._caches)
        return {
            name: cache.backend.num_ready()
            for name, cache in caches.items()
            if isinstance(cache.backend, SandboxedBackend)
        }

    def close(self) -> None:
        """Stop every compiler process."""
        with self._lock:
            caches, self._caches = list(self._caches.values()), {}
        for cache in caches:
            cache.close()

    def submit(self, constraint: StructuredOutput) -> Future[CompiledGrammar]:
        """Start compiling (or find the cached grammar); never raises: errors are in the future."""
        try:
            started = time.perf_counter()
            future = self._cache(constraint.backend).submit(constraint)
            if not future.done():  # a compile to wait for (a cached grammar is done already)
                future.add_done_callback(
                    lambda _: metrics.GRAMMAR_COMPILE_SECONDS.observe(time.perf_counter() - started)
                )
            return future
        except Exception as exc:
            failed: Future[CompiledGrammar] = Future()
            failed.set_exception(exc)
            return failed


def _count_limit_errors(error: GrammarError) -> None:
    if isinstance(error, GrammarLimitError):
        metrics.GRAMMAR_COMPILE_TIMEOUTS.inc()
