"""OpenAI Chat Completions response shapes: completion, stream chunks, usage. Pure: values in, dicts out."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    """With n > 1 the prompt counts once and ``num_output_tokens`` is the sum over the choices."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def logprobs_field(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A choice's ``logprobs``: null unless the request asked for them."""
    return None if entries is None else {"content": entries}


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: list[dict[str, Any]] | None
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs_field(logprobs),
        "finish_reason": finish_reason,
    }


@dataclass(frozen=True, slots=True)
class ChunkWriter:
    """The objects of one response: same id and created on every chunk.

    With ``include_usage`` every chunk carries ``"usage": null`` and the last one the totals, as
    OpenAI's stream does.
    """

    request_id: str
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, object_: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_, "created": self.created, "model": self.model}

    def chunk(
        self,
        index: int,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One choice's delta; ``logprobs`` are the entries of the tokens whose text it carries."""
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs_field(logprobs),
            "finish_reason": finish_reason,
        }
        body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": usage_}

    def completion(self, choices: list[dict[str, Any]], usage_: dict[str, Any]) -> dict[str, Any]:
        return {**self._head("chat.completion"), "choices": choices, "usage": usage_}
