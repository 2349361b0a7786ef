"""GrammarCache: one compile per key while it runs, LRU eviction, failures not cached. The backend
is the real xgrammar one, gated by an event so a test controls when a compile finishes."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from libs.grammar.backend import CompiledGrammar, GrammarBackend, GrammarError
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


def test_failures_are_not_cached(gated: GatedBackend) -> None:
    gated.gate.set()
    cache = GrammarCache(gated)
    failed = cache.submit(regex("(ab"))
    with pytest.raises(GrammarError):
        failed.result(timeout=30)
    retry = cache.submit(regex("(ab"))
    assert retry is not failed
    with pytest.raises(GrammarError):
        retry.result(timeout=30)
    with pytest.raises(GrammarError):
        cache.get(regex("(ab"))
    assert gated.num_compiles == 3 and len(cache) == 0
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
