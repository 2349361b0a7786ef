"""Checks output constraints before a request is queued, so a bad one is a 400, not a failure
mid-generation. Results (problems included) are cached per constraint: a schema sent again costs a
dict lookup. Runs on the thread that renders the prompt, never on the event loop (the first check
imports the grammar library, which takes a second or two)."""

from __future__ import annotations

import functools
import logging

from libs.grammar import validate
from libs.grammar.backend import GrammarError
from libs.protocol.messages import StructuredOutput, StructuredOutputKind
from libs.recipe.fields import ApiError

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1024)
def _problem(constraint: StructuredOutput) -> GrammarError | None:
    try:
        validate(constraint)
    except GrammarError as exc:
        return exc
    return None


def warm_grammar(backend: str) -> None:
    """Check the simplest constraint once: it imports the backend's library. Never raises (a
    missing library is then the first constrained request's error, not the gateway's end)."""
    try:
        _problem(StructuredOutput(StructuredOutputKind.JSON, backend=backend))
    except Exception as exc:
        log.warning("grammar backend %s unavailable: %s", backend, exc)


def check_constraint(constraint: StructuredOutput, param: str) -> None:
    """Raise a 400 ApiError naming the problem; ``param`` is the request field it came from."""
    problem = _problem(constraint)
    if problem is not None:
        where = f"{param}.{problem.param}" if problem.param else param
        raise ApiError(400, f"Invalid schema for {param}: {problem}", param=where)
