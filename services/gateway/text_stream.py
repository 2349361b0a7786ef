"""One choice's token deltas -> text pieces with their tokens' logprobs. Pure (no I/O, no asyncio).

Incremental detokenization, then stop strings. Each token's text occupies a span [start, end) of
the choice's decoded text; the text sent so far is always a prefix of it (stop strings only hold
text back or cut it). Logprobs follow the text by these rules:

- a token's record goes out with the piece that completes its text (``end <= sent``); a token with
  no text of its own (a special token, or the first bytes of a character split across tokens)
  goes out with the first text after it (``start < sent``), or at the end of the choice;
- when a stop string ends the choice, the text from the stop string on is never sent, and the
  records of the tokens whose text begins before the stop string are sent (the token that
  straddles it included); the records of the rest, which lie wholly in or beyond it, are dropped;
- when the choice ends otherwise, every remaining record goes out with the last piece.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from libs.protocol.messages import FinishReason
from libs.recipe.tokenizer import IncrementalDetokenizer, Tokenizer
from services.gateway.logprobs import TokenLogprob
from services.gateway.service import Delta
from services.gateway.stop_strings import StopStringMatcher


@dataclass(frozen=True, slots=True)
class Piece:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


class ChoiceText:
    """After the piece that ends the choice: ``finish_reason`` (OpenAI spelling), ``stopped``
    (a stop string ended it here), ``error``; ``num_output_tokens`` is kept up to date."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._matcher = StopStringMatcher(stop)
        self._spans: deque[tuple[int, int, TokenLogprob]] = deque()  # records not sent yet
        self._num_decoded = 0  # characters out of the detokenizer so far
        self._num_sent = 0  # characters sent so far (a prefix of the decoded text)
        self.finish_reason: str | None = None
        self.stopped = False
        self.error = ""
        self.num_output_tokens = 0

    def feed(self, delta: Delta) -> Piece:
        if self.finish_reason is not None:
            return Piece("")
        self.num_output_tokens = delta.num_output_tokens
        decoded = self._decode(delta)
        ending = delta.finish_reason is not None
        if ending:
            tail = self._detokenizer.flush()  # an incomplete character at the end becomes U+FFFD
            self._num_decoded += len(tail)
            decoded += tail
        text = self._matcher.feed(decoded)
        if ending and not self._matcher.stopped:
            text += self._matcher.flush()
        self._num_sent += len(text)
        if self._matcher.stopped:
            self.stopped = True
            self.finish_reason = "stop"
            records = self._release(lambda start, _end: start < self._num_sent)
            self._spans.clear()
        elif delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason.openai
            if delta.finish_reason is FinishReason.ERROR:
                self.error = delta.error or "the request failed"
            records = self._release(lambda _start, _end: True)
        else:
            records = self._release(lambda start, end: start < self._num_sent and end <= self._num_sent)
        return Piece(text, records)

    def _decode(self, delta: Delta) -> str:
        """Decode token by token so that each token's span is known (the text is the same)."""
        if not delta.logprobs:
            text = self._detokenizer.add(delta.token_ids)
            self._num_decoded += len(text)
            return text
        parts = []
        for record in delta.logprobs:
            text = self._detokenizer.add((record.token_id,))
            start, self._num_decoded = self._num_decoded, self._num_decoded + len(text)
            self._spans.append((start, self._num_decoded, record))
            parts.append(text)
        return "".join(parts)

    def _release(self, ready: Callable[[int, int], bool]) -> tuple[TokenLogprob, ...]:
        # ready(start, end): may that token's record go out now. Spans are in text order and each
        # rule is monotone along them, so the records ready to go are always a prefix of the queue.
        out = []
        while self._spans and ready(self._spans[0][0], self._spans[0][1]):
            out.append(self._spans.popleft()[2])
        return tuple(out)
