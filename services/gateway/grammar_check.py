"""Checks output constraints before a request is queued, so a bad one is a 400, not a failure
mid-generation: each constraint is compiled over the model's vocabulary in a bounded child process
(libs.grammar.sandbox), so a hostile one (a regex whose index explodes) is a 400 naming the bound
that it passed, and never reaches a worker. Results (problems included) are cached per
constraint: a schema sent again costs a dict lookup, except that a bound passed is remembered for
``LIMIT_MEMORY_S`` only (under load a fair schema may pass the time bound once). A backend that
cannot serve (it does not import, or its compiler processes do not start) is the server's
trouble: a 503. Runs on the thread that renders the prompt, never on the event loop (a check
waits up to the compile's time bound)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence

from libs.grammar import BACKENDS, backend_problem, unknown_backend
from libs.grammar.backend import BackendUnavailable, GrammarError, GrammarLimitError
from libs.grammar.sandbox import CompileLimits, SandboxedBackend, sandboxed_backend
from libs.protocol.messages import StructuredOutput
from libs.recipe.fields import ApiError

log = logging.getLogger(__name__)

LIMIT_MEMORY_S = 60.0  # how long a constraint that passed a compile bound is refused without a compile


class GrammarCheck:
    """The gateway's bounded, cached compile check. ``vocab[i]``: token i's bytes (b"": never
    text). Compiler processes start on ``warm`` or on the first check that needs them."""

    def __init__(self, vocab: Sequence[bytes], limits: CompileLimits | None = None) -> None:
        self.vocab = list(vocab)
        self.limits = limits if limits is not None else CompileLimits()
        self._backends: dict[str, SandboxedBackend] = {}
        self._lock = threading.Lock()
        # BackendUnavailable is raised, not returned: it is never cached; nor is a bound passed.
        self._problem = functools.lru_cache(maxsize=1024)(self._compile_problem)
        self._over_limit: dict[StructuredOutput, tuple[float, GrammarLimitError]] = {}

    def warm(self, backend: str) -> None:
        """Start ``backend``'s compiler processes now and wait until they are ready. Never raises
        (an unavailable backend is then each constrained request's 400, not the gateway's end)."""
        try:
            self._backend(backend).start()
        except Exception as exc:
            log.warning("grammar backend %s unavailable: %s", backend, exc)

    def check(self, constraint: StructuredOutput, param: str) -> None:
        """Raise a 400 ApiError naming the problem; ``param`` is the request field it came from."""
        problem: GrammarError | None
        try:
            problem = self._limit_problem(constraint) or self._problem(constraint)
        except GrammarLimitError as exc:
            problem = exc
        except BackendUnavailable as exc:
            raise ApiError(503, f"structured output is unavailable: {exc}", type_="server_error") from exc
        if problem is not None:
            where = f"{param}.{problem.param}" if problem.param else param
            raise ApiError(400, f"Invalid schema for {param}: {problem}", param=where)

    def pids(self) -> list[int]:
        """The compiler processes' pids, every backend's."""
        with self._lock:
            backends = list(self._backends.values())
        return [pid for backend in backends for pid in backend.pids()]

    def close(self) -> None:
        with self._lock:
            backends, self._backends = list(self._backends.values()), {}
        for backend in backends:
            backend.close()

    def _backend(self, name: str) -> SandboxedBackend:
        if name not in BACKENDS:
            raise unknown_backend(name)
        problem = backend_problem(name)  # as resolve_backend saw it at start-up: a missing one is a 400
        if problem is not None:
            raise BackendUnavailable(f"grammar backend {name} is unavailable: {problem}")
        with self._lock:
            backend = self._backends.get(name)
            if backend is None:
                backend = self._backends[name] = sandboxed_backend(name, self.vocab, self.limits)
            return backend

    def _limit_problem(self, constraint: StructuredOutput) -> GrammarLimitError | None:
        with self._lock:
            remembered = self._over_limit.get(constraint)
            if remembered is not None and time.monotonic() > remembered[0]:
                del self._over_limit[constraint]
                return None
        return None if remembered is None else remembered[1]

    def _compile_problem(self, constraint: StructuredOutput) -> GrammarError | None:
        try:
            self._backend(constraint.backend).check(constraint)
        except BackendUnavailable:
            raise
        except GrammarLimitError as exc:  # remembered a while, not for good: raised, not cached
            with self._lock:
                self._over_limit[constraint] = (time.monotonic() + LIMIT_MEMORY_S, exc)
                if len(self._over_limit) > 1024:
                    self._over_limit.pop(next(iter(self._over_limit)))
            raise
        except GrammarError as exc:
            return exc
        return None
