"""Compiles in child processes: past the time bound the child is SIGKILLed (its pid is gone, a
fresh child takes its place), past the memory bound the compile fails naming it, a failing
factory makes the backend unavailable, and a real backend's grammar comes back working exactly
like the one compiled in this process. Every child here is a real process."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch

from libs.grammar import BACKENDS
from libs.grammar.backend import BackendUnavailable, GrammarError, GrammarLimitError
from libs.grammar.cache import GrammarCache
from libs.grammar.sandbox import CompileLimits, SandboxedBackend, sandboxed_backend
from libs.protocol.messages import StructuredOutput, StructuredOutputKind
from libs.recipe.tokenizer import Tokenizer
from tests.unit.grammar.sandbox_fakes import FakeCompiled

FAKES = "tests.unit.grammar.sandbox_fakes"


def fake(spec: str) -> StructuredOutput:
    return StructuredOutput(StructuredOutputKind.REGEX, spec, "fake")


def make_fake(limits: CompileLimits, factory: str = "FakeBackend") -> SandboxedBackend:
    return SandboxedBackend("fake", 7, f"{FAKES}:{factory}", (7,), limits, lambda payload: payload)


@pytest.fixture
def sandbox() -> Iterator[SandboxedBackend]:
    backend = make_fake(CompileLimits(timeout_s=1, max_mb=256, num_procs=1))
    yield backend
    backend.close()


def gone(pid: int) -> bool:
    """No process ``pid`` any more (killed and reaped: not even a zombie)."""
    return not os.path.exists(f"/proc/{pid}")


def exited(pid: int) -> bool:
    """Process ``pid`` ended (a zombie until its parent reaps it, or gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("spec", ["spin", "sleep"])
def test_a_compile_past_the_time_bound_is_killed_and_replaced(sandbox: SandboxedBackend, spec: str) -> None:
    assert sandbox.compile(fake("ok")) == FakeCompiled("ok", 7)
    [pid] = sandbox.pids()
    with pytest.raises(GrammarLimitError, match=r"grammar compilation exceeded 1 s"):
        sandbox.compile(fake(spec))
    assert gone(pid)  # its CPU stopped with it
    [fresh] = sandbox.pids()
    assert fresh != pid
    assert sandbox.compile(fake("again")) == FakeCompiled("again", 7)


def test_a_child_killed_while_idle_is_replaced_not_blamed_on_the_next_compile(
    sandbox: SandboxedBackend,
) -> None:
    assert sandbox.compile(fake("ok")) == FakeCompiled("ok", 7)
    [pid] = sandbox.pids()
    os.kill(pid, signal.SIGKILL)  # an operator's kill -9, the OOM killer
    while not exited(pid):
        time.sleep(0.01)
    assert sandbox.compile(fake("again")) == FakeCompiled("again", 7)
    [fresh] = sandbox.pids()
    assert fresh != pid


def test_a_compile_past_the_memory_bound_fails_naming_it() -> None:
    # A time bound well past what the allocation takes on a loaded machine (a niced child): the
    # memory bound, not the clock, must end it.
    sandbox = make_fake(CompileLimits(timeout_s=20, max_mb=256, num_procs=1))
    try:
        sandbox.start()
        [pid] = sandbox.pids()
        with pytest.raises(GrammarLimitError, match=r"grammar compilation exceeded 256 MB"):
            sandbox.compile(fake("alloc"))
        assert gone(pid)  # a child whose allocation failed is not reused
        assert sandbox.compile(fake("ok")) == FakeCompiled("ok", 7)
    finally:
        sandbox.close()


def test_a_grammar_error_comes_back_and_keeps_the_child(sandbox: SandboxedBackend) -> None:
    with pytest.raises(GrammarError, match="a bad spec") as info:
        sandbox.compile(fake("bad"))
    assert not isinstance(info.value, GrammarLimitError) and info.value.param == "spec"
    [pid] = sandbox.pids()
    sandbox.check(fake("ok"))
    assert sandbox.pids() == [pid]


def test_a_backend_that_does_not_import_is_unavailable() -> None:
    backend = make_fake(CompileLimits(num_procs=1), factory="missing_backend")
    with pytest.raises(BackendUnavailable, match="deepinfer_no_such_module"):
        backend.start()
    with pytest.raises(BackendUnavailable, match="deepinfer_no_such_module"):
        backend.compile(fake("ok"))
    backend.close()


def test_the_cache_remembers_a_compile_past_its_bound(sandbox: SandboxedBackend) -> None:
    cache = GrammarCache(sandbox, max_workers=1)
    first = cache.submit(fake("spin"))
    with pytest.raises(GrammarLimitError):
        first.result(timeout=60)
    [pid] = sandbox.pids()
    again = cache.submit(fake("spin"))
    assert again.done() and isinstance(again.exception(), GrammarLimitError)
    assert sandbox.pids() == [pid]  # nothing burnt again: the same child, never used
    cache.close()
    assert gone(pid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_real_grammar_comes_back_working_like_one_compiled_here(
    backend: str,
    vocab: list[bytes],
    tokenizer: Tokenizer,
    stop_ids: tuple[int, ...],
    caches: dict[str, GrammarCache],
) -> None:
    constraint = StructuredOutput(StructuredOutputKind.REGEX, r"[a-z]{3,8}@[a-z]+\.(com|org)", backend)
    sandboxed = sandboxed_backend(backend, vocab, CompileLimits(timeout_s=60, num_procs=1))
    try:
        here = caches[backend].get(constraint).matcher(stop_ids)
        there = sandboxed.compile(constraint).matcher(stop_ids)
    finally:
        sandboxed.close()
    masks = torch.zeros(2, (len(vocab) + 31) // 32, dtype=torch.int32)
    for token_id in [*tokenizer.encode_plain("jane@example.org"), stop_ids[0]]:
        here.fill_mask(masks, 0)
        there.fill_mask(masks, 1)
        assert torch.equal(masks[0], masks[1]) and masks[0].any()
        assert here.advance(token_id) and there.advance(token_id)
    assert here.is_terminated() and there.is_terminated()
    assert not there.advance(tokenizer.encode_plain("x")[0])


def test_outlines_running_out_of_its_memory_bound_fails_naming_it() -> None:
    """outlines-core aborts the process when an allocation fails (Rust), unlike Python's
    MemoryError: the parent reads the child's death as the memory bound."""
    backend = sandboxed_backend("outlines", [bytes([b]) for b in range(256)], CompileLimits(60, 64, 1))
    try:
        with pytest.raises(GrammarLimitError, match=r"grammar compilation exceeded 64 MB"):
            backend.check(StructuredOutput(StructuredOutputKind.REGEX, ".*x.{16}", "outlines"))  # GBs of DFA
    finally:
        backend.close()
