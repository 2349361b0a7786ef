"""Validates output constraints before a request is queued, so a bad one is a 400, not a failure
mid-generation. Results (errors included) are cached by grammar key: a schema sent again costs a
dict lookup. Runs on the thread that renders the prompt, never on the event loop (the first check
imports the grammar library, which takes a second or two)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from libs.grammar import validate
from libs.grammar.backend import GrammarError, grammar_key
from libs.protocol.messages import StructuredOutput
from libs.recipe.fields import ApiError


class GrammarCheck:
    def __init__(self, max_entries: int = 1024) -> None:
        self.max_entries = max_entries
        self._results: OrderedDict[str, GrammarError | None] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, constraint: StructuredOutput, param: str) -> None:
        """Raise a 400 ApiError naming the problem; ``param`` is the request field it came from."""
        key = grammar_key(constraint)
        with self._lock:
            cached = self._results.get(key, _MISSING)
            if cached is not _MISSING:
                self._results.move_to_end(key)
        if cached is _MISSING:
            try:
                validate(constraint)
                cached = None
            except GrammarError as exc:
                cached = exc
            with self._lock:
                self._results[key] = cached
                while len(self._results) > self.max_entries:
                    self._results.popitem(last=False)
        if isinstance(cached, GrammarError):
            where = f"{param}.{cached.param}" if cached.param else param
            raise ApiError(400, f"Invalid schema for {param}: {cached}", param=where)


_MISSING = GrammarError("")  # sentinel: never stored as a result
