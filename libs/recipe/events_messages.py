"""Anthropic Messages events: one message's segments -> stream events, and events -> the message body. Pure.

An event is the JSON-ready dict of one SSE message (its ``type`` is also the SSE ``event:`` name).
``MessagesEncoder`` renders one message; ``MessagesAccumulator`` rebuilds the non-stream body from
those very events, so the two cannot diverge.

Content blocks open and close strictly one at a time, and a block's ``index`` is its position in
the final ``content`` array: a thinking block per run of reasoning, a text block per run of
content, a ``tool_use`` block per tool call (its input streamed as ``input_json_delta``). A
thinking block's signature arrives as a ``signature_delta`` right before its stop, as Anthropic
sends it. One ``ping`` follows the first block start, as deepseek-recipe does.

Usage: ``input_tokens`` excludes the cached prompt tokens, which are ``cache_read_input_tokens``
(Anthropic's split; their sum is the prompt). ``message_delta.usage`` is cumulative.
"""

from __future__ import annotations

import json
from typing import Any

from libs.recipe.segments import Finish, Reasoning, Segment, ToolCallArgs, ToolCallStart, Usage


def messages_usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }


def stop_reason(finish: Finish, has_tool_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a finish other than "error".

    A tool call wins over eos and over a stop sequence (the client must run the tools to go on);
    "max_tokens" wins over a tool call (a cut-off call must not run). "abort" reads as
    "end_turn": Anthropic has no spelling for a cancelled message.
    """
    if finish.reason == "length":
        return "max_tokens", None
    if finish.reason in ("eos", "stop_sequence") and has_tool_calls:
        return "tool_use", None
    if finish.reason == "stop_sequence":
        return "stop_sequence", finish.stop_sequence
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's ``input`` object from its arguments' JSON text.

    Empty text is ``{}``. Text that is not a JSON object is kept whole as ``{"arguments": text}``
    rather than dropped: the same single-string-parameter form DeepSeek's prompt renders for a
    historical call whose arguments are not an object, so nothing is lost on the round trip.
    """
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": arguments}


class MessagesEncoder:
    """Events of one message, fed its segments in order."""

    def __init__(self, message_id: str, model: str, *, signature: str) -> None:
        self._id = message_id
        self._model = model
        self._signature = signature
        self._blocks = 0  # blocks started so far; the open one, if any, is the last
        self._open: str | None = None  # the open block's type
        self._call_index = -1  # the open tool_use block's tool-call index
        self._tool_calls = False
        self._state = "new"  # new -> streaming -> done

    def start(self, usage_in: Usage) -> list[dict[str, Any]]:
        """``message_start``; ``usage_in`` gives the prompt side (its completion count is ignored)."""
        if self._state != "new":
            raise ValueError("message already started")
        self._state = "streaming"
        usage = {**messages_usage(usage_in), "output_tokens": 0}
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return [{"type": "message_start", "message": message}]

    def feed(self, segments: list[Segment]) -> list[dict[str, Any]]:
        self._live()
        events: list[dict[str, Any]] = []
        for segment in segments:
            if isinstance(segment, ToolCallStart):
                events += self._stop()
                self._tool_calls = True
                self._call_index = segment.index
                block = {"type": "tool_use", "id": segment.call_id, "name": segment.name, "input": {}}
                events += self._begin(block)
            elif isinstance(segment, ToolCallArgs):
                if self._open != "tool_use" or segment.index != self._call_index:
                    raise ValueError(f"arguments for tool call {segment.index}, which is not the open block")
                if segment.text:
                    events.append(self._delta({"type": "input_json_delta", "partial_json": segment.text}))
            elif segment.text:
                if isinstance(segment, Reasoning):
                    if self._open != "thinking":
                        events += self._stop()
                        events += self._begin({"type": "thinking", "thinking": "", "signature": ""})
                    events.append(self._delta({"type": "thinking_delta", "thinking": segment.text}))
                else:
                    if self._open != "text":
                        events += self._stop()
                        events += self._begin({"type": "text", "text": ""})
                    events.append(self._delta({"type": "text_delta", "text": segment.text}))
        return events

    def finish(self, finish: Finish, usage: Usage) -> list[dict[str, Any]]:
        """The open block's stop, ``message_delta`` and ``message_stop``; for an error only an
        ``error`` event (Anthropic's mid-stream failure: the message is never completed)."""
        self._live()
        self._state = "done"
        if finish.reason == "error":
            error = {"type": "api_error", "message": finish.error or "generation failed"}
            return [{"type": "error", "error": error}]
        events = self._stop()
        reason, sequence = stop_reason(finish, self._tool_calls)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        events.append({"type": "message_delta", "delta": delta, "usage": messages_usage(usage)})
        events.append({"type": "message_stop"})
        return events

    def _live(self) -> None:
        if self._state != "streaming":
            raise ValueError(f"message not streaming ({self._state})")

    def _begin(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self._open = block["type"]
        events = [{"type": "content_block_start", "index": self._blocks, "content_block": block}]
        self._blocks += 1
        if self._blocks == 1:
            events.append({"type": "ping"})
        return events

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._blocks - 1, "delta": delta}

    def _stop(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        events = []
        if self._open == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": self._signature}))
        self._open = None
        events.append({"type": "content_block_stop", "index": self._blocks - 1})
        return events


# Which field of its block each delta type appends to.
_DELTA_FIELDS = {
    "text_delta": ("text", "text"),
    "thinking_delta": ("thinking", "thinking"),
    "signature_delta": ("signature", "signature"),
    "input_json_delta": ("partial_json", "_json"),
}


class MessagesAccumulator:
    """Rebuilds the message body from a ``MessagesEncoder``'s events, in order.

    ``error`` is the error event's ``error`` object if the stream failed (the body is then partial).
    """

    def __init__(self) -> None:
        self._message: dict[str, Any] | None = None
        self._blocks: list[dict[str, Any]] = []
        self._pieces: list[dict[str, list[str]]] = []  # per block: delta texts per field, joined at stop
        self.error: dict[str, Any] | None = None

    def add(self, event: dict[str, Any]) -> None:
        type_ = event["type"]
        if type_ == "message_start":
            self._message = dict(event["message"])
        elif type_ == "content_block_start":
            if event["index"] != len(self._blocks):
                raise ValueError(f"block {event['index']} started, expected {len(self._blocks)}")
            self._blocks.append(dict(event["content_block"]))
            self._pieces.append({})
        elif type_ == "content_block_delta":
            source, target = _DELTA_FIELDS[event["delta"]["type"]]
            self._pieces[event["index"]].setdefault(target, []).append(event["delta"][source])
        elif type_ == "content_block_stop":
            self._close(event["index"])
        elif type_ == "message_delta":
            message = self._started()
            message.update(event["delta"])
            message["usage"] = {**message["usage"], **event["usage"]}
        elif type_ == "error":
            self.error = event["error"]

    def result(self) -> dict[str, Any]:
        for index in range(len(self._blocks)):
            self._close(index)  # a block a failed stream never stopped
        return {**self._started(), "content": [dict(block) for block in self._blocks]}

    def _close(self, index: int) -> None:
        block, pieces = self._blocks[index], self._pieces[index]
        for target, texts in pieces.items():
            block[target] = block.get(target, "") + "".join(texts)
        pieces.clear()
        if block["type"] == "tool_use" and "_json" in block:
            block["input"] = tool_input(block.pop("_json"))

    def _started(self) -> dict[str, Any]:
        if self._message is None:
            raise ValueError("no message_start accumulated")
        return self._message
