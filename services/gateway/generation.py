"""A request's run from step-output deltas to its API's events; the same for live and resumed streams.

``Generation`` owns the per-choice pipeline (detokenizer -> output parser -> segments, logprobs
aligned to the text) and hands segments to an ``ApiRenderer``, which speaks one API. Everything
it needs is in the request's ``StreamRecord``, and nothing in it depends on the clock or on
chance, so replaying the same step outputs yields the same events: a resumed client skips the
events it has (by their ordinal, the SSE ``id``) and gets the rest.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from libs.protocol.stream_messages import StreamRecord
from libs.recipe.output_parser import OutputParser, ParserSpec
from libs.recipe.segments import Finish, Segment, Usage
from libs.recipe.tokenizer import Tokenizer
from services.gateway.logprobs import LogprobRenderer
from services.gateway.request_stream import RequestStream
from services.gateway.text_stream import ChoiceText


@dataclass(frozen=True, slots=True)
class Event:
    """One SSE event: ``name`` for the ``event:`` line (None: data only, as Chat does)."""

    name: str | None
    data: Any  # a JSON-ready dict, or a str sent as is ("[DONE]")


KEEPALIVE = Event(None, "")  # nothing to say yet: the SSE side writes a comment line


class ApiRenderer(Protocol):
    """One API's view of a generation. ``body()`` is the non-streaming response, built from the
    same events the stream sends, so the two cannot disagree."""

    def open(self, usage: Usage) -> list[Event]:
        """The opening events; ``usage`` has the prompt side (known once the first output came)."""
        ...

    def feed(
        self, index: int, segments: list[Segment], logprobs: list[dict[str, Any]] | None
    ) -> list[Event]: ...

    def end_choice(self, index: int, finish: Finish) -> list[Event]: ...

    def close(self, usage: Usage, error: str) -> list[Event]: ...

    def body(self) -> dict[str, Any]: ...


class GenerationObserver(Protocol):
    """Told what a live generation sees as it sees it (its metrics); the clock is the observer's."""

    def tokens(self, index: int) -> None:
        """A delta with tokens of choice ``index`` came."""
        ...

    def ended_with(self, usage: Usage, error: str) -> None: ...


def parser_spec(record: StreamRecord, index: int) -> ParserSpec:
    return ParserSpec(
        syntax=record.syntax,  # type: ignore[arg-type]
        start=record.start,  # type: ignore[arg-type]
        parse_tool_calls=record.parse_tool_calls,
        stop=record.stop,
        call_id_seed=f"{record.request_id}/{index}",
    )


class Generation:
    """After ``events`` is exhausted: ``error`` (empty unless the request failed), ``usage``."""

    def __init__(
        self,
        record: StreamRecord,
        tokenizer: Tokenizer,
        renderer: ApiRenderer,
        keep_token_ids: frozenset[int] = frozenset(),
        observer: GenerationObserver | None = None,
    ) -> None:
        self.renderer = renderer
        self._observer = observer
        self._choices = [
            ChoiceText(tokenizer, OutputParser(parser_spec(record, i)), keep_token_ids)
            for i in range(record.n)
        ]
        self._logprobs = LogprobRenderer(tokenizer, record.top_logprobs) if record.logprobs else None
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0
        self._num_prediction_tokens = [0, 0]  # accepted, rejected
        self.error = ""
        self.usage = Usage(0, 0)

    async def events(self, stream: RequestStream, idle_s: float | None = None) -> AsyncIterator[Event]:
        """Every event of the request, in order; ends when every choice has (or one failed).
        ``KEEPALIVE`` whenever the request was silent for ``idle_s``."""
        opened = False
        async for delta in stream.deltas(idle_s):
            if delta is None:
                yield KEEPALIVE
                continue
            if delta.token_ids and self._observer is not None:
                self._observer.tokens(delta.index)
            self._num_prompt_tokens = delta.num_prompt_tokens or self._num_prompt_tokens
            self._num_cached_tokens = max(self._num_cached_tokens, delta.num_cached_tokens)
            self._num_prediction_tokens[0] += delta.num_accepted_prediction_tokens
            self._num_prediction_tokens[1] += delta.num_rejected_prediction_tokens
            if not opened:
                opened = True
                for event in self.renderer.open(Usage(self._num_prompt_tokens, 0, self._num_cached_tokens)):
                    yield event
            choice = self._choices[delta.index]
            piece = choice.feed(delta)
            if choice.stopped:
                stream.stop_choice(delta.index)
            entries = None if self._logprobs is None else self._logprobs.entries(piece.logprobs)
            for event in self.renderer.feed(delta.index, piece.segments, entries):
                yield event
            if choice.finish is None:
                continue
            if choice.finish.reason == "error":
                self.error = choice.finish.error
                break
            for event in self.renderer.end_choice(delta.index, choice.finish):
                yield event
        self.usage = Usage(
            self._num_prompt_tokens,
            sum(c.num_output_tokens for c in self._choices),
            self._num_cached_tokens,
            sum(c.num_reasoning_tokens for c in self._choices),
            *self._num_prediction_tokens,
        )
        if self._observer is not None:
            self._observer.ended_with(self.usage, self.error)
        if not opened:  # failed before any output
            for event in self.renderer.open(self.usage):
                yield event
        for event in self.renderer.close(self.usage, self.error):
            yield event


async def numbered(events: AsyncIterator[Event], after: int = -1) -> AsyncIterator[tuple[int | None, Event]]:
    """Events with their ordinals (the SSE ids), skipping those up to ``after`` (a resume).
    A keep-alive is not an event of the stream: it has no ordinal."""
    ordinal = -1
    async for event in events:
        if event is KEEPALIVE:
            yield None, event
            continue
        ordinal += 1
        if ordinal > after:
            yield ordinal, event
