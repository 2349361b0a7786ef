"""OpenAI Chat Completions events: segments -> stream chunks, and chunks -> the non-stream body. Pure.

A chunk is the JSON-ready dict that goes in one SSE ``data:`` line. ``ChatEncoder`` renders the
choices of one request; ``ChatAccumulator`` rebuilds the ``chat.completion`` body from those very
chunks, so a non-streamed answer is by construction what the stream would have said. Ids and
``created`` come from the caller, so re-rendering a stream gives the same chunks.

Shapes follow OpenAI: the first chunk of a choice carries ``role``; a tool call's first fragment
carries ``id``, ``type``, ``function.name`` and empty ``arguments``, later ones only ``index`` and
argument text; the finishing chunk has an empty delta; usage travels in its own chunk with
``choices: []``. DeepSeek's ``reasoning_content`` carries reasoning text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from libs.recipe.segments import Finish, Reasoning, Segment, ToolCallArgs, ToolCallStart, Usage


def chat_usage(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage object plus DeepSeek's cache hit/miss counters (extra keys clients ignore)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {
            "reasoning_tokens": usage.reasoning_tokens,
            "accepted_prediction_tokens": usage.accepted_prediction_tokens,
            "rejected_prediction_tokens": usage.rejected_prediction_tokens,
        },
        "prompt_cache_hit_tokens": usage.cached_tokens,
        "prompt_cache_miss_tokens": usage.prompt_tokens - usage.cached_tokens,
    }


def chat_finish_reason(finish: Finish, has_tool_calls: bool) -> str | None:
    """None for "error": that choice gets no finish chunk; the caller sends an error event instead.

    "length" wins over tool calls (a cut-off call must not be dispatched), and so does "abort",
    which reads as "stop": Chat has no spelling for a cancelled choice.
    """
    if finish.reason == "error":
        return None
    if finish.reason == "length":
        return "length"
    if finish.reason in ("eos", "stop_sequence") and has_tool_calls:
        return "tool_calls"
    return "stop"


@dataclass(slots=True)
class _Choice:
    started: bool = False
    finished: bool = False
    tool_calls: set[int] = field(default_factory=set)
    wants_logprobs: bool = False
    # Entries of tokens whose text has not been sent yet (held back by the parser, or markup):
    # they ride on the choice's next chunk so none is lost and the order is kept.
    pending_logprobs: list[dict[str, Any]] = field(default_factory=list)


class ChatEncoder:
    """Chunks for the ``n`` choices of one completion; each choice is fed in order, choices interleave."""

    def __init__(
        self,
        completion_id: str,
        model: str,
        created: int,
        *,
        reasoning: bool,
        n: int = 1,
        include_usage: bool = False,
    ) -> None:
        self._head: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }
        self._reasoning = reasoning
        # With stream_options.include_usage OpenAI puts "usage": null on every choice chunk.
        self._include_usage = include_usage
        self._choices = [_Choice() for _ in range(n)]

    def start(self, index: int) -> list[dict[str, Any]]:
        """The choice's first chunk: the role, and an empty ``reasoning_content`` for thinking models."""
        choice = self._choice(index)
        if choice.started:
            raise ValueError(f"choice {index} already started")
        choice.started = True
        delta: dict[str, Any] = {"role": "assistant", "content": ""}
        if self._reasoning:
            delta["reasoning_content"] = ""
        return [self._chunk(index, choice, delta, None)]

    def feed(
        self, index: int, segments: list[Segment], logprobs: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """One chunk per run of like segments; ``logprobs``: the entries of the tokens just decoded."""
        choice = self._live(index)
        if logprobs is not None:
            choice.wants_logprobs = True
            choice.pending_logprobs.extend(logprobs)
        return [self._chunk(index, choice, delta, None) for delta in self._deltas(choice, segments)]

    def finish(self, index: int, finish: Finish, has_tool_calls: bool | None = None) -> list[dict[str, Any]]:
        """The closing chunk (empty delta + ``finish_reason``); none for an error.

        ``has_tool_calls`` defaults to whether this choice was fed a tool call.
        """
        choice = self._live(index)
        choice.finished = True
        tools = bool(choice.tool_calls) if has_tool_calls is None else has_tool_calls
        reason = chat_finish_reason(finish, tools)
        if reason is None:
            return []
        return [self._chunk(index, choice, {}, reason)]

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """OpenAI's trailing usage chunk (``choices: []``), sent when the request asked for usage."""
        return {**self._head, "choices": [], "usage": chat_usage(usage)}

    def _choice(self, index: int) -> _Choice:
        if not 0 <= index < len(self._choices):
            raise ValueError(f"choice index {index} outside 0..{len(self._choices) - 1}")
        return self._choices[index]

    def _live(self, index: int) -> _Choice:
        choice = self._choice(index)
        if not choice.started or choice.finished:
            raise ValueError(f"choice {index} is not streaming (started={choice.started})")
        return choice

    def _chunk(
        self, index: int, choice: _Choice, delta: dict[str, Any], finish_reason: str | None
    ) -> dict[str, Any]:
        logprobs = {"content": choice.pending_logprobs} if choice.wants_logprobs else None
        choice.pending_logprobs = []
        choice_body = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        body: dict[str, Any] = {**self._head, "choices": [choice_body]}
        if self._include_usage:
            body["usage"] = None
        return body

    def _deltas(self, choice: _Choice, segments: list[Segment]) -> list[dict[str, Any]]:
        """Merges consecutive text of one kind (and argument text of one call) into one delta."""
        deltas: list[dict[str, Any]] = []
        key: tuple[str, int] | None = None  # what the last delta holds, so a like segment can join it
        for segment in segments:
            if isinstance(segment, ToolCallStart):
                if segment.index in choice.tool_calls:
                    raise ValueError(f"tool call {segment.index} started twice")
                choice.tool_calls.add(segment.index)
                call = {"index": segment.index, "id": segment.call_id, "type": "function"}
                call["function"] = {"name": segment.name, "arguments": ""}
                deltas.append({"tool_calls": [call]})
                key = None  # the first fragment stays exactly id + name + empty arguments
                continue
            if not segment.text:
                continue
            if isinstance(segment, ToolCallArgs):
                if segment.index not in choice.tool_calls:
                    raise ValueError(f"arguments for tool call {segment.index} before its start")
                if key == ("args", segment.index):
                    deltas[-1]["tool_calls"][0]["function"]["arguments"] += segment.text
                else:
                    fragment = {"index": segment.index, "function": {"arguments": segment.text}}
                    deltas.append({"tool_calls": [fragment]})
                    key = ("args", segment.index)
                continue
            name = "reasoning_content" if isinstance(segment, Reasoning) else "content"
            if key == (name, 0):
                deltas[-1][name] += segment.text
            else:
                deltas.append({name: segment.text})
                key = (name, 0)
        return deltas


@dataclass(slots=True)
class _Built:
    content: list[str] = field(default_factory=list)
    reasoning: list[str] | None = None  # None until some delta carried reasoning_content
    # per call index: id, and the name and argument pieces (joined once, in ``_choice``)
    tool_calls: dict[int, tuple[str | None, list[str], list[str]]] = field(default_factory=dict)
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None


class ChatAccumulator:
    """Rebuilds the ``chat.completion`` body from the chunks a ``ChatEncoder`` produced, in order."""

    def __init__(self) -> None:
        self._head: dict[str, Any] | None = None
        self._choices: dict[int, _Built] = {}
        self._usage: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        if self._head is None:
            self._head = {k: chunk[k] for k in ("id", "created", "model")}
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            self._apply(self._choices.setdefault(choice["index"], _Built()), choice)

    def result(self) -> dict[str, Any]:
        if self._head is None:
            raise ValueError("no chunks accumulated")
        choices = [self._choice(index, built) for index, built in sorted(self._choices.items())]
        body = {
            "id": self._head["id"],
            "object": "chat.completion",
            "created": self._head["created"],
            "model": self._head["model"],
            "choices": choices,
            "usage": self._usage,
        }
        return body

    @staticmethod
    def _apply(built: _Built, choice: dict[str, Any]) -> None:
        delta = choice["delta"]
        if delta.get("content"):
            built.content.append(delta["content"])
        if "reasoning_content" in delta:
            built.reasoning = built.reasoning if built.reasoning is not None else []
            built.reasoning.append(delta["reasoning_content"] or "")
        for fragment in delta.get("tool_calls") or []:
            function = fragment.get("function") or {}
            _, names, arguments = built.tool_calls.setdefault(fragment["index"], (fragment.get("id"), [], []))
            names.append(function.get("name") or "")
            arguments.append(function.get("arguments") or "")
        if choice.get("logprobs") is not None:
            built.logprobs = built.logprobs if built.logprobs is not None else []
            built.logprobs.extend(choice["logprobs"].get("content") or [])
        if choice.get("finish_reason") is not None:
            built.finish_reason = choice["finish_reason"]

    @staticmethod
    def _choice(index: int, built: _Built) -> dict[str, Any]:
        content = "".join(built.content)
        calls = [
            {"id": call_id, "type": "function", "function": {"name": "".join(n), "arguments": "".join(a)}}
            for call_id, n, a in (built.tool_calls[i] for i in sorted(built.tool_calls))
        ]
        # OpenAI's shape: a message that only calls tools has content null, not "".
        message: dict[str, Any] = {"role": "assistant", "content": None if calls and not content else content}
        if built.reasoning is not None:
            message["reasoning_content"] = "".join(built.reasoning)
        if calls:
            message["tool_calls"] = calls
        return {
            "index": index,
            "message": message,
            "logprobs": None if built.logprobs is None else {"content": built.logprobs},
            "finish_reason": built.finish_reason,
        }
