"""A request's n choices over its one delta stream: each delta to its choice, out as rendered events.

Choices interleave in arrival order. A stop string ends its own choice only (that sequence is
cancelled; the others go on); an error in any choice ends the whole request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from libs.recipe.tokenizer import Tokenizer
from services.gateway.logprobs import LogprobRenderer
from services.gateway.responses import completion_choice
from services.gateway.sampling import Sampling
from services.gateway.service import RequestStream
from services.gateway.text_stream import ChoiceText


@dataclass(frozen=True, slots=True)
class ChoiceEvent:
    index: int
    text: str
    logprobs: list[dict[str, Any]] | None  # entries of the tokens this text carries; None: not asked
    finish_reason: str | None  # set on the event that ends this choice


class Choices:
    """After ``events`` is exhausted: ``error`` (empty unless a choice failed), token counts."""

    def __init__(self, tokenizer: Tokenizer, sampling: Sampling) -> None:
        self._texts = [ChoiceText(tokenizer, sampling.stop) for _ in range(sampling.n)]
        self._renderer = None
        if sampling.base.logprobs:
            self._renderer = LogprobRenderer(tokenizer, sampling.base.top_logprobs)
        self.error = ""

    @property
    def n(self) -> int:
        return len(self._texts)

    @property
    def num_output_tokens(self) -> int:
        return sum(t.num_output_tokens for t in self._texts)

    async def events(self, stream: RequestStream) -> AsyncIterator[ChoiceEvent]:
        """Until every choice has ended, or one fails: then ``error`` is set and the caller's
        ``stream.close()`` cancels the choices still running."""
        async for delta in stream:
            choice = self._texts[delta.index]
            piece = choice.feed(delta)
            if choice.stopped:
                stream.stop_choice(delta.index)
            logprobs = None if self._renderer is None else self._renderer.entries(piece.logprobs)
            if choice.error:
                self.error = choice.error
                yield ChoiceEvent(delta.index, piece.text, logprobs, None)
                return
            yield ChoiceEvent(delta.index, piece.text, logprobs, choice.finish_reason)

    async def collect(self, stream: RequestStream) -> list[dict[str, Any]]:
        """Every choice whole, in OpenAI's non-streaming shape, ordered by index."""
        texts: list[list[str]] = [[] for _ in self._texts]
        entries: list[list[dict[str, Any]]] = [[] for _ in self._texts]
        async for event in self.events(stream):
            texts[event.index].append(event.text)
            entries[event.index] += event.logprobs or []
        return [
            completion_choice(
                i, "".join(texts[i]), t.finish_reason, None if self._renderer is None else entries[i]
            )
            for i, t in enumerate(self._texts)
        ]
