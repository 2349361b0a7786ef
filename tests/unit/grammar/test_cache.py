"""GrammarCache: one compile per key while it runs, LRU eviction, a constraint's GrammarError
cached but not an unavailable backend. The backend is the real xgrammar one, gated by an event so
a test controls when a compile finishes."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from libs.grammar.backend import (
    BackendUnavailable,
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarLimitError,
)
from libs.grammar.cache import GrammarCache
from libs.protocol.messages import StructuredOutput, StructuredOutputKind


class GatedBackend:
    """The real backend, compiling only once ``gate`` is set; counts compiles."""

    def __init__(self, backend: GrammarBackend) -> None:
        self.name = backend.name
        self.vocab_size = backend.vocab_size
        self.backend = backend
        self.gate = threading.Event()
        self.num_compiles = 0

    def compile(self, constraint: StructuredOutput) -> CompiledGrammar:
        self.num_compiles += 1
        assert self.gate.wait(timeout=30)
        return self.backend.compile(constraint)


def regex(pattern: str) -> StructuredOutput:
    return StructuredOutput(StructuredOutputKind.REGEX, pattern, "xgrammar")


@pytest.fixture
def gated(caches: dict[str, GrammarCache]) -> GatedBackend:
    return GatedBackend(caches["xgrammar"].backend)


def test_same_future_while_compiling_then_cached(gated: GatedBackend) -> None:
    cache = GrammarCache(gated, max_entries=4)
    first = cache.submit(regex("a+"))
    assert cache.submit(regex("a+")) is first and not first.done()
    other = cache.submit(regex("b+"))
    assert other is not first
    gated.gate.set()
    compiled = first.result(timeout=30)
    assert other.result(timeout=30) is not compiled
    again = cache.submit(regex("a+"))
    assert again.done() and again.result() is compiled and cache.get(regex("a+")) is compiled
    assert gated.num_compiles == 2 and len(cache) == 2
    cache.close()


def test_lru_eviction(gated: GatedBackend) -> None:
    gated.gate.set()
    cache = GrammarCache(gated, max_entries=2)
    a = cache.get(regex("a"))
    cache.get(regex("b"))
    assert cache.get(regex("a")) is a  # "a" is now the most recent
    cache.get(regex("c"))  # evicts "b"
    assert regex("a") in cache and regex("c") in cache and regex("b") not in cache
    cache.get(regex("b"))
    assert gated.num_compiles == 4 and len(cache) == 2
    cache.close()


def test_grammar_errors_are_cached(gated: GatedBackend) -> None:
    gated.gate.set()
    cache = GrammarCache(gated)
    failed = cache.submit(regex("(ab"))
    with pytest.raises(GrammarError):
        failed.result(timeout=30)
    again = cache.submit(regex("(ab"))
    assert again.done() and isinstance(again.exception(), GrammarError)  # not compiled again
    with pytest.raises(GrammarError):
        cache.get(regex("(ab"))
    assert gated.num_compiles == 1 and regex("(ab") in cache
    cache.close()


class UnavailableBackend:
    """A backend whose library cannot be used right now; counts compiles."""

    name = "xgrammar"
    vocab_size = 3

    def __init__(self) -> None:
        self.num_compiles = 0

    def compile(self, constraint: StructuredOutput) -> CompiledGrammar:
        self.num_compiles += 1
        raise BackendUnavailable("grammar backend xgrammar is unavailable: its compiler died")


def test_an_unavailable_backend_is_not_cached() -> None:
    backend = UnavailableBackend()
    cache = GrammarCache(backend)
    first = cache.submit(regex("a"))
    with pytest.raises(BackendUnavailable):
        first.result(timeout=30)
    retry = cache.submit(regex("a"))
    assert retry is not first
    with pytest.raises(BackendUnavailable):
        retry.result(timeout=30)
    assert backend.num_compiles == 2 and len(cache) == 0
    cache.close()


def test_concurrent_submits_share_one_compile(gated: GatedBackend) -> None:
    cache = GrammarCache(gated)
    futures: list[Future[CompiledGrammar]] = []
    lock = threading.Lock()

    def submit() -> None:
        future = cache.submit(regex("[0-9]+"))
        with lock:
            futures.append(future)

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    gated.gate.set()
    assert len({id(future) for future in futures}) == 1
    assert futures[0].result(timeout=30) is cache.get(regex("[0-9]+"))
    assert gated.num_compiles == 1
    cache.close()


class OverLimit:
    """A backend whose every compile passes its bound (as a sandbox reports it); counts them."""

    name = "xgrammar"
    vocab_size = 8

    def __init__(self) -> None:
        self.num_compiles = 0

    def compile(self, constraint: StructuredOutput) -> CompiledGrammar:
        self.num_compiles += 1
        raise GrammarLimitError("grammar compilation exceeded 10 s")


def test_a_compile_past_its_bound_is_remembered_for_a_while_only() -> None:
    """Under load a fair grammar may pass the time bound once: it is refused from the cache for
    ``limit_memory_s``, then compiled again; each compile that failed is reported once."""
    backend, errors = OverLimit(), []
    cache = GrammarCache(backend, on_error=errors.append, limit_memory_s=3600.0)
    for _ in range(3):
        with pytest.raises(GrammarLimitError):
            cache.get(regex("a+"))
    assert backend.num_compiles == 1 and len(errors) == 1
    cache.limit_memory_s = 0.0
    with pytest.raises(GrammarLimitError):
        cache.get(regex("b+"))
    with pytest.raises(GrammarLimitError):
        cache.get(regex("b+"))  # forgotten at once: compiled again
    assert backend.num_compiles == 3 and len(errors) == 3
    cache.close()
