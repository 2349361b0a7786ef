"""One choice's token deltas -> output segments with their tokens' logprobs. Pure (no I/O, no asyncio).

Incremental detokenization, then the output parser (reasoning / content / tool calls, stop
strings in content). Each token's text occupies a span [start, end) of the choice's decoded text;
the parser has decided a prefix of it (``num_consumed``: emitted, skipped or matched; the rest is
held back as a possible marker). Logprobs follow the text by these rules:

- a token's record goes out with the piece that completes the decided text over it
  (``end <= consumed``); a token with no text of its own (a special token, or the first bytes of
  a character split across tokens) goes out with the first text after it, or at the end;
- when a stop string ends the choice, the text from the stop string on is never sent, and the
  records of the tokens whose text begins before the stop string are sent (the token that
  straddles it included); the records of the rest, which lie wholly in or beyond it, are dropped;
- when the choice ends otherwise, every remaining record goes out with the last piece.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from libs.protocol.messages import FinishReason
from libs.recipe.output_parser import OutputParser, merge_segments
from libs.recipe.segments import EndReason, Finish, Segment
from libs.recipe.tokenizer import IncrementalDetokenizer, Tokenizer
from services.gateway.logprobs import TokenLogprob
from services.gateway.request_stream import Delta

_END: dict[FinishReason, EndReason] = {
    FinishReason.STOP: "eos",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}


@dataclass(frozen=True, slots=True)
class Piece:
    segments: list[Segment]
    logprobs: tuple[TokenLogprob, ...] = ()


class ChoiceText:
    """After the piece that ends the choice: ``finish`` is set and ``stopped`` says whether a stop
    string ended it here (the scheduler must then drop the sequence); ``num_output_tokens`` is
    kept up to date."""

    def __init__(self, tokenizer: Tokenizer, parser: OutputParser, keep_token_ids: frozenset[int]) -> None:
        # Special tokens are dropped from the text, except those that spell the parser's markers.
        self._detokenizer = IncrementalDetokenizer(tokenizer, keep_token_ids=keep_token_ids)
        self.parser = parser
        self._spans: deque[tuple[int, int, TokenLogprob]] = deque()  # records not sent yet
        self._num_decoded = 0  # characters out of the detokenizer so far
        self.finish: Finish | None = None
        self.stopped = False
        self.num_output_tokens = 0
        self.num_reasoning_tokens = 0

    def feed(self, delta: Delta) -> Piece:
        if self.finish is not None:
            return Piece([])
        self.num_output_tokens = delta.num_output_tokens
        texts = self._decode(delta)
        if delta.finish_reason is not None:
            tail = self._detokenizer.flush()  # an incomplete character at the end becomes U+FFFD
            self._num_decoded += len(tail)
            texts.append(tail)
        segments = self._parse(texts, len(delta.token_ids))
        parser = self.parser
        if delta.finish_reason is not None and not parser.finished:
            segments += parser.finish()
        if parser.finished:
            self.stopped = True
            self.finish = Finish("stop_sequence", parser.stop_sequence)
            stop_at = parser.stop_offset if parser.stop_offset is not None else parser.num_consumed
            records = self._release(lambda start, _end: start < stop_at)
            self._spans.clear()
        elif delta.finish_reason is not None:
            error = delta.error or "the request failed" if delta.finish_reason is FinishReason.ERROR else ""
            self.finish = Finish(_END[delta.finish_reason], error=error)
            records = self._release(lambda _start, _end: True)
        else:
            consumed = parser.num_consumed
            records = self._release(lambda start, end: start < consumed and end <= consumed)
        return Piece(merge_segments(segments), records)

    def _parse(self, texts: list[str], num_tokens: int) -> list[Segment]:
        """Token by token while the output may be reasoning (to count its tokens), then at once.
        ``texts`` holds one text per token, then the detokenizer's tail at the end of a stream,
        which is no token and is not counted."""
        parser = self.parser
        segments: list[Segment] = []
        i = 0
        while i < len(texts) and parser.may_reason:
            segments += parser.feed(texts[i])
            if i < num_tokens:
                self.num_reasoning_tokens += parser.reasoning  # the token that closes it is not
            i += 1
        return segments + parser.feed("".join(texts[i:]))

    def _decode(self, delta: Delta) -> list[str]:
        """Each token's text (the same text as decoding them at once), its span kept for logprobs."""
        texts = []
        for token_id, record in itertools.zip_longest(delta.token_ids, delta.logprobs):
            text = self._detokenizer.add((token_id,))
            start, self._num_decoded = self._num_decoded, self._num_decoded + len(text)
            if record is not None:
                self._spans.append((start, self._num_decoded, record))
            texts.append(text)
        return texts

    def _release(self, ready: Callable[[int, int], bool]) -> tuple[TokenLogprob, ...]:
        # ready(start, end): may that token's record go out now. Spans are in text order and each
        # rule is monotone along them, so the records ready to go are always a prefix of the queue.
        out = []
        while self._spans and ready(self._spans[0][0], self._spans[0][1]):
            out.append(self._spans.popleft()[2])
        return tuple(out)
