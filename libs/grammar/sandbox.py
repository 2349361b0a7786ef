"""Grammar compiles in killable child processes, bounded in time and in memory.

A compile can explode (outlines-core's index over the vocabulary grows exponentially for some
regexes) and a thread running native code cannot be stopped, so every compile runs in a warm
child process that built its backend once from the vocabulary. Past ``timeout_s`` the parent
SIGKILLs the child (its CPU stops with it) and starts a fresh one; past ``max_mb`` of address
space beyond what the warm child holds (RLIMIT_AS, set once its backend is built) allocations
fail in the child. Either way the compile raises GrammarLimitError naming the bound. The result
comes back portable: xgrammar's CompiledGrammar as its serialize_json text (the parent re-attaches
its own TokenizerInfo), anything else (outlines-core's Index included) pickled.

Protocol, pickled tuples over one socket per child (multiprocessing.connection framing):
parent -> (factory, args, max_mb, timeout_s) once; child -> ("ready",) | ("error", why); then per
compile parent -> (constraint, export); child -> ("ok", payload) | ("grammar", message, param) |
("memory",). ``python -m libs.grammar.sandbox FD`` is the child's entry point.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import queue
import resource
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Final

from libs.grammar.backend import (
    BackendUnavailable,
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarLimitError,
)
from libs.protocol.messages import StructuredOutput

log = logging.getLogger(__name__)

_XGRAMMAR_JSON: Final = "xgrammar-json"  # payload tag: CompiledGrammar.serialize_json() text
# A child killed by one of these while compiling ran out of address space (Rust aborts on a failed
# allocation, a C++ one may crash; the kernel's OOM killer sends SIGKILL).
_MEMORY_SIGNALS: Final = frozenset({signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGKILL})
# The child's own CPU backstop per compile (RLIMIT_CPU, soft): a child whose parent died while it
# compiled stops by itself. Several compile threads may run, so CPU time outruns wall time.
_CPU_FACTOR: Final = 4
_CPU_SLACK_S: Final = 5


@dataclass(frozen=True, slots=True)
class CompileLimits:
    timeout_s: float = 10.0  # wall time of one compile, transfer of its result included
    max_mb: int = 2048  # address space one compile may add to the warm child, MiB
    num_procs: int = 2  # warm children per backend: compiles that run at once
    start_timeout_s: float = 120.0  # a child importing its backend (torch, for xgrammar), indexing the vocab

    def __post_init__(self) -> None:
        if not (self.timeout_s > 0 and self.max_mb > 0 and self.num_procs > 0 and self.start_timeout_s > 0):
            raise ValueError(f"grammar compile limits must all be > 0, got {self}")


def time_limit_error(limits: CompileLimits) -> GrammarLimitError:
    return GrammarLimitError(f"grammar compilation exceeded {limits.timeout_s:g} s")


def memory_limit_error(limits: CompileLimits, how: str = "") -> GrammarLimitError:
    return GrammarLimitError(f"grammar compilation exceeded {limits.max_mb} MB{how}")


class _Child:
    """One warm compiler process. Used by one thread at a time (the pool hands it out)."""

    def __init__(self, factory: str, args: tuple[Any, ...], limits: CompileLimits) -> None:
        parent_end, child_end = socket.socketpair()
        # The child imports what this process imports (tests' factories included).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(os.path.abspath(p) for p in sys.path if p))
        with child_end:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "libs.grammar.sandbox", str(child_end.fileno())],
                pass_fds=(child_end.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # stdout is nobody's; its logs go to stderr
                env=env,
            )
        self.conn = Connection(parent_end.detach())
        self.ready = False
        # A stop closes the pool while a start-up wait may be killing the same child: the socket
        # is closed once (a second close could hit a descriptor reused meanwhile).
        self._close_lock = threading.Lock()
        with contextlib.suppress(OSError):  # it died already: wait_ready reports how
            self.conn.send((factory, args, limits.max_mb, limits.timeout_s))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, name: str, timeout_s: float) -> None:
        if self.ready:
            return
        try:
            reply = (
                self.conn.recv() if self.conn.poll(timeout_s) else ("error", f"no start in {timeout_s:g} s")
            )
        except (EOFError, OSError):
            reply = ("error", f"its compiler process exited with code {self.proc.wait()}")
        if reply[0] != "ready":
            self.kill()
            raise BackendUnavailable(f"grammar backend {name} is unavailable: {reply[1]}")
        self.ready = True

    def run(self, constraint: StructuredOutput, export: bool, limits: CompileLimits) -> Any:
        """The payload of one compile (None unless ``export``). Raises GrammarError; after a
        GrammarLimitError this child is dead."""
        try:
            self.conn.send((constraint, export))
            if not self.conn.poll(limits.timeout_s):
                self.kill()
                raise time_limit_error(limits)
            reply = self.conn.recv()
        except (EOFError, OSError):
            raise self._died(limits) from None
        if reply[0] == "ok":
            return reply[1]
        if reply[0] == "memory":
            self.kill()  # a fresh process after a failed allocation: native state may be torn
            raise memory_limit_error(limits)
        raise GrammarError(reply[1], reply[2])

    def _died(self, limits: CompileLimits) -> GrammarError:
        code = self.proc.wait()
        self._close_conn()
        if code == -signal.SIGXCPU:
            return time_limit_error(limits)
        if -code in _MEMORY_SIGNALS:
            return memory_limit_error(limits, f" (the compiler died of {signal.Signals(-code).name})")
        return GrammarError(f"the grammar compiler exited with code {code}")

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: native code holding the CPU cannot ignore it
        self.proc.wait()
        self._close_conn()

    def _close_conn(self) -> None:
        with self._close_lock:
            if not self.conn.closed:
                self.conn.close()


class SandboxedBackend:
    """A GrammarBackend whose compiles run in ``limits.num_procs`` warm children. ``factory``
    ("module:function") called with ``args`` builds the real backend in each child; ``restore``
    turns a child's payload back into a CompiledGrammar here."""

    def __init__(
        self,
        name: str,
        vocab_size: int,
        factory: str,
        args: tuple[Any, ...],
        limits: CompileLimits,
        restore: Callable[[Any], CompiledGrammar],
    ) -> None:
        self.name = name
        self.vocab_size = vocab_size
        self.limits = limits
        self._factory = factory
        self._args = args
        self._restore = restore
        # None: a slot whose child is not started yet (or was lost while starting).
        self._idle: queue.SimpleQueue[_Child | None] = queue.SimpleQueue()
        self._children: set[_Child] = set()
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(limits.num_procs):
            self._idle.put(None)

    def start(self, wait: bool = True) -> None:
        """Start every child; with ``wait``, until they are ready (raises BackendUnavailable)."""
        taken: list[_Child] = []
        try:  # a child that fails to start gives back the ones taken before it
            for _ in range(self.limits.num_procs):
                taken.append(self._take())
            for child in taken if wait else ():
                child.wait_ready(self.name, self.limits.start_timeout_s)
        finally:
            for child in taken:
                self._give_back(child)

    def compile(self, constraint: StructuredOutput) -> CompiledGrammar:
        return self._restore(self._run(constraint, True))

    def check(self, constraint: StructuredOutput) -> None:
        """Compile in a child without bringing the result back (the gateway's check)."""
        self._run(constraint, False)

    def pids(self) -> list[int]:
        with self._lock:
            return [child.pid for child in self._children]

    def num_ready(self) -> int:
        """Children started, ready to compile and alive (one killed while idle is replaced when
        next taken)."""
        with self._lock:
            return sum(child.ready and child.proc.poll() is None for child in self._children)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            children, self._children = list(self._children), set()
        for child in children:
            child.kill()

    def _run(self, constraint: StructuredOutput, export: bool) -> Any:
        child = self._take()  # waits while every child compiles
        # A child that died while idle (killed from outside: kill -9, the OOM killer) says
        # nothing of this constraint: sent to it, the compile would be taken for one that killed
        # it (and cached as over its bound). A fresh child in its place compiles it instead.
        for _ in range(self.limits.num_procs):
            if child.proc.poll() is None:
                break
            self._give_back(child)
            child = self._take()
        try:
            child.wait_ready(self.name, self.limits.start_timeout_s)
            return child.run(constraint, export, self.limits)
        finally:
            self._give_back(child)

    def _take(self) -> _Child:
        child = self._idle.get()
        if self._closed:  # a compile racing shutdown: start nothing that nobody would stop
            if child is not None:
                child.kill()
            raise BackendUnavailable(f"grammar backend {self.name} is closed")
        if child is None:
            try:
                child = _Child(self._factory, self._args, self.limits)
            except BaseException:
                self._idle.put(None)
                raise
            with self._lock:
                self._children.add(child)
        return child

    def _give_back(self, child: _Child) -> None:
        """Return ``child`` to the pool, or a fresh one (started now, warming while idle) in place
        of one that died; a child that never got ready leaves an empty slot."""
        if child.proc.poll() is None:
            self._idle.put(child)
            return
        with self._lock:
            self._children.discard(child)
            replace = child.ready and not self._closed
        if not replace:
            self._idle.put(None)
            return
        try:
            fresh = _Child(self._factory, self._args, self.limits)
        except OSError:
            log.exception("could not start a grammar compiler process")
            self._idle.put(None)
            return
        with self._lock:
            self._children.add(fresh)
        self._idle.put(fresh)


def sandboxed_backend(name: str, vocab: Sequence[bytes], limits: CompileLimits) -> SandboxedBackend:
    """The backend ``name`` (as libs.grammar.make_backend builds it) compiling in children."""
    vocab = list(vocab)
    return SandboxedBackend(
        name, len(vocab), "libs.grammar:make_backend", (name, vocab), limits, _Restorer(vocab)
    )


class _Restorer:
    """Payload -> CompiledGrammar: xgrammar's JSON is re-attached to a TokenizerInfo built here
    once, exactly as the child's backend built its own (deserialize_json checks that they match)."""

    def __init__(self, vocab: list[bytes]) -> None:
        self._vocab = vocab
        self._info: Any = None
        self._lock = threading.Lock()

    def __call__(self, payload: Any) -> CompiledGrammar:
        if not (isinstance(payload, tuple) and payload[:1] == (_XGRAMMAR_JSON,)):
            compiled: CompiledGrammar = payload  # pickled whole (outlines-core's Index pickles)
            return compiled
        import xgrammar as xgr

        from libs.grammar.xgrammar_backend import XGrammarCompiled, tokenizer_info

        with self._lock:
            if self._info is None:
                self._info = tokenizer_info(self._vocab)
        return XGrammarCompiled(xgr.CompiledGrammar.deserialize_json(payload[1], self._info))


# ----- the child -----


def _export(compiled: CompiledGrammar) -> Any:
    xgrammar_backend = sys.modules.get("libs.grammar.xgrammar_backend")
    if xgrammar_backend is not None and isinstance(compiled, xgrammar_backend.XGrammarCompiled):
        return (_XGRAMMAR_JSON, compiled.compiled.serialize_json())
    return compiled


def _limit_memory(max_mb: int) -> None:
    """Cap the address space at what the warm child maps now plus ``max_mb``."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    limit = mapped + max_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _limit_cpu(timeout_s: float) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + _CPU_FACTOR * timeout_s + _CPU_SLACK_S)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.getrlimit(resource.RLIMIT_CPU)[1]))


def _build(factory: str, args: tuple[Any, ...]) -> GrammarBackend:
    module, _, attr = factory.partition(":")
    backend: GrammarBackend = getattr(importlib.import_module(module), attr)(*args)
    return backend


def _compile_one(backend: GrammarBackend, constraint: StructuredOutput, export: bool) -> tuple[Any, ...]:
    try:
        compiled = backend.compile(constraint)
        return ("ok", _export(compiled) if export else None)
    except MemoryError:
        return ("memory",)
    except GrammarError as exc:
        return ("grammar", str(exc), exc.param)
    except Exception as exc:  # a backend's own failure on this constraint: the constraint's error
        return ("grammar", f"the {backend.name} backend cannot compile this constraint: {exc}", "")


def child_main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the parent ends this one (EOF)
    # A hostile compile burns its whole bound: at a low priority, the steps and event loops of the
    # processes beside it keep their cores.
    os.nice(10)
    conn = Connection(fd)
    factory, args, max_mb, timeout_s = conn.recv()
    try:
        backend = _build(factory, args)
    except BaseException as exc:  # ImportError above all: the parent falls back or reports it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    _limit_memory(max_mb)
    conn.send(("ready",))
    while True:
        try:
            constraint, export = conn.recv()
        except (EOFError, ConnectionResetError):  # the parent closed the pool, or died (kill -9)
            return
        _limit_cpu(timeout_s)
        reply = _compile_one(backend, constraint, export)
        try:
            conn.send(reply)
        except MemoryError:  # pickling the result (before anything is written) ran out
            reply = ("memory",)
            conn.send(reply)
        if reply[0] == "memory":
            return


if __name__ == "__main__":
    # The parent may go (a stop, a kill -9) at any point, a start-up still warming included: a
    # send or receive on the closed socket then ends this process, quietly (nobody is listening).
    with contextlib.suppress(BrokenPipeError, ConnectionResetError, EOFError):
        child_main(int(sys.argv[1]))
