"""Token deltas of one request -> text pieces: incremental detokenization, then stop strings."""

from __future__ import annotations

from collections.abc import AsyncIterator

from libs.protocol.messages import FinishReason
from libs.recipe.tokenizer import IncrementalDetokenizer, Tokenizer
from services.gateway.service import RequestStream
from services.gateway.stop_strings import StopStringMatcher


class TextStream:
    """After ``pieces`` is exhausted: ``finish_reason`` (OpenAI spelling), ``error``, token count."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._matcher = StopStringMatcher(stop)
        self.finish_reason = "stop"
        self.error = ""
        self.num_output_tokens = 0

    async def pieces(self, stream: RequestStream) -> AsyncIterator[str]:
        async for delta in stream:
            self.num_output_tokens = delta.num_output_tokens
            text = self._matcher.feed(self._detokenizer.add(delta.token_ids))
            if self._matcher.stopped:
                stream.close()  # a stop string ends the request: the scheduler is told to drop it
                self.finish_reason = "stop"
                yield text
                return
            if delta.finish_reason is not None:
                text += self._matcher.feed(self._detokenizer.flush()) + self._matcher.flush()
                self.finish_reason = delta.finish_reason.openai
                if delta.finish_reason is FinishReason.ERROR:
                    self.error = delta.error or "the request failed"
            yield text
