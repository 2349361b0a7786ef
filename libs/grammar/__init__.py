"""Grammar-constrained decoding: the backends, the gateway's ``validate`` and (in cache.py) the
worker's compile cache.

Backends are imported on first use: xgrammar alone takes about two seconds to import (it imports
torch and transformers), and the gateway only needs it once a request carries a constraint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from libs.grammar.backend import GrammarBackend, GrammarError
from libs.protocol.messages import StructuredOutput

BACKENDS: Final = ("xgrammar", "outlines")


def make_backend(name: str, vocab: Sequence[bytes]) -> GrammarBackend:
    """The backend ``name`` for a model whose token i stands for ``vocab[i]`` (b"": never text).
    ``len(vocab)`` is the logits width, so masks are ``ceil(len(vocab) / 32)`` words wide."""
    if name == "xgrammar":
        from libs.grammar.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(vocab)
    if name == "outlines":
        from libs.grammar.outlines_backend import OutlinesBackend

        return OutlinesBackend(vocab)
    raise GrammarError(f"unknown grammar backend {name!r} (expected one of {', '.join(BACKENDS)})", "backend")


def validate(constraint: StructuredOutput) -> None:
    """Raise GrammarError for anything the worker would fail to compile; needs no vocabulary."""
    if constraint.backend == "xgrammar":
        from libs.grammar import xgrammar_backend

        xgrammar_backend.validate(constraint)
    elif constraint.backend == "outlines":
        from libs.grammar import outlines_backend

        outlines_backend.validate(constraint)
    else:
        raise GrammarError(
            f"unknown grammar backend {constraint.backend!r} (expected one of {', '.join(BACKENDS)})",
            "backend",
        )
