"""Grammar-constrained decoding: the backends, which of them can be used here, ``validate`` and
(in cache.py and sandbox.py) the bounded, cached compiles of the worker and the gateway.

Backends are imported on first use: xgrammar alone takes about two seconds to import (it imports
torch and transformers).
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Collection, Sequence
from types import ModuleType
from typing import Final, Protocol

from libs.grammar.backend import SPECIAL_BYTES, BackendUnavailable, GrammarBackend, GrammarError
from libs.protocol.messages import StructuredOutput

log = logging.getLogger(__name__)

BACKENDS: Final = ("xgrammar", "outlines")


class TokenBytes(Protocol):
    special_token_ids: frozenset[int]

    def token_bytes(self, token_id: int) -> bytes: ...


def grammar_vocab(tokenizer: TokenBytes, vocab_size: int, markup_ids: Collection[int] = ()) -> list[bytes]:
    """The bytes of each token id as grammars see it: ``SPECIAL_BYTES`` for ``markup_ids``, the
    tokens a call syntax puts in its markup (never text: a structure reaches them by id), b"" for
    other special tokens and for ids past the tokenizer (a padded embedding table): never produced."""
    special = tokenizer.special_token_ids
    markup = frozenset(markup_ids)
    return [
        SPECIAL_BYTES if i in markup else b"" if i in special else tokenizer.token_bytes(i)
        for i in range(vocab_size)
    ]


def _module(name: str) -> ModuleType:
    """The backend's module (importing its library). Raises GrammarError, BackendUnavailable."""
    if name not in BACKENDS:
        raise unknown_backend(name)
    problem = backend_problem(name)
    if problem is not None:
        raise BackendUnavailable(f"grammar backend {name} is unavailable: {problem}")
    return importlib.import_module(f"libs.grammar.{name}_backend")


def unknown_backend(name: str) -> GrammarError:
    return GrammarError(
        f"unknown grammar backend {name!r} (expected one of {', '.join(BACKENDS)})", "backend"
    )


@functools.cache
def backend_problem(name: str) -> str | None:
    """Why backend ``name`` cannot be imported in this process; None when it can."""
    try:
        importlib.import_module(f"libs.grammar.{name}_backend")
    except Exception as exc:  # ImportError mostly; a broken native library may raise others
        return f"{type(exc).__name__}: {exc}"
    return None


def resolve_backend(name: str) -> str:
    """``name`` if its library imports here, else the other backend, with a warning naming both.
    Raises RuntimeError when none imports (a broken install: the service must not start)."""
    problem = backend_problem(name)
    if problem is None:
        return name
    problems = {name: problem}
    for other in BACKENDS:
        if other == name:
            continue
        other_problem = backend_problem(other)
        if other_problem is None:
            log.warning("grammar backend %s is unavailable (%s): using %s instead", name, problem, other)
            return other
        problems[other] = other_problem
    why = "; ".join(f"{backend}: {reason}" for backend, reason in problems.items())
    raise RuntimeError(f"no grammar backend is available ({why})")


def make_backend(name: str, vocab: Sequence[bytes]) -> GrammarBackend:
    """The backend ``name`` for a model whose token i stands for ``vocab[i]`` (b"": never text).
    ``len(vocab)`` is the logits width, so masks are ``ceil(len(vocab) / 32)`` words wide."""
    module = _module(name)
    backend: GrammarBackend = (module.XGrammarBackend if name == "xgrammar" else module.OutlinesBackend)(
        vocab
    )
    return backend


def validate(constraint: StructuredOutput) -> None:
    """Raise GrammarError for anything the worker would fail to compile; needs no vocabulary,
    and is unbounded: run it where a runaway compile harms no one (sandbox.py bounds compiles)."""
    _module(constraint.backend).validate(constraint)
