"""OpenAI Responses events: one response's segments -> stream events, and events -> the response object. Pure.

An event is the JSON-ready dict of one SSE message (its ``type`` is also the SSE ``event:`` name);
every event carries ``sequence_number`` 0, 1, 2, ... ``ResponsesEncoder`` owns the lifecycle
fields of the caller's response skeleton (``status``, ``output``, ``usage``, ``error``,
``incomplete_details``, ``completed_at``); ``ResponsesAccumulator`` rebuilds the final object from
the events, so a non-streamed body is what the stream said.

Output items open and close strictly in order, one at a time: a reasoning item (one
``reasoning_text`` part), a message item (one ``output_text`` part), a ``function_call`` item per
tool call. Item ids are ``rs_/msg_/fc_{base}_{output_index}`` where ``base`` is the response id
without a leading ``resp_``: deterministic, so a resumed stream re-renders the same ids. A message
item is ``phase: "final_answer"`` when added and ``"commentary"`` when a tool call closed it (the
text was a preamble), as deepseek-recipe does.
"""

from __future__ import annotations

import copy
from typing import Any

from libs.recipe.segments import Finish, Reasoning, Segment, ToolCallArgs, ToolCallStart, Usage

_PREFIXES = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


def responses_usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponsesEncoder:
    """Events of one response, fed the single choice's segments in order."""

    def __init__(self, response: dict[str, Any]) -> None:
        self._response = copy.deepcopy(response)
        self._response.update(
            object="response",
            status="in_progress",
            output=[],
            usage=None,
            error=None,
            incomplete_details=None,
            completed_at=None,
        )
        rid = str(self._response["id"])
        self._base = rid.removeprefix("resp_")
        self._seq = 0
        self._items: list[dict[str, Any]] = []  # every item added so far, the open one last
        self._open = False  # whether the last item is still open
        self._texts: list[str] = []  # the open item's text (or arguments) so far
        self._call_index = -1  # the open function_call's tool-call index
        self._phase = "start"  # start -> queued? -> running -> done

    @property
    def response(self) -> dict[str, Any]:
        """The response object as it stands (a copy): what a retrieval of this response returns."""
        return self._snapshot()

    def start(self, *, queued: bool = False) -> list[dict[str, Any]]:
        """``response.created`` then ``response.in_progress``, or ``response.queued`` for a background
        request still waiting; the first ``feed`` or ``finish`` then reports ``in_progress``."""
        if self._phase != "start":
            raise ValueError("response already started")
        self._phase = "queued" if queued else "running"
        self._response["status"] = "queued" if queued else "in_progress"
        events = [self._lifecycle("response.created")]
        events.append(self._lifecycle("response.queued" if queued else "response.in_progress"))
        return events

    def feed(self, segments: list[Segment]) -> list[dict[str, Any]]:
        events = self._run()
        for segment in segments:
            if isinstance(segment, ToolCallStart):
                events += self._close("completed", tool_follows=True)
                events += self._add_call(segment)
            elif isinstance(segment, ToolCallArgs):
                if not (self._open and self._items[-1]["type"] == "function_call"):
                    raise ValueError(f"arguments for tool call {segment.index}, which is not open")
                if segment.index != self._call_index:
                    raise ValueError(
                        f"arguments for tool call {segment.index} while {self._call_index} is open"
                    )
                events += self._delta(segment.text)
            elif segment.text:
                kind = "reasoning" if isinstance(segment, Reasoning) else "message"
                if not (self._open and self._items[-1]["type"] == kind):
                    events += self._close("completed", tool_follows=False)
                    events += self._add_text_item(kind)
                events += self._delta(segment.text)
        return events

    def finish(self, finish: Finish, usage: Usage, completed_at: int | None) -> list[dict[str, Any]]:
        """The open item's close, then the terminal event.

        eos/stop_sequence -> ``response.completed``; length -> ``response.incomplete`` (reason
        ``max_output_tokens``); error -> ``response.failed`` with ``error.code = "server_error"``;
        abort -> status ``cancelled`` but no lifecycle event, since OpenAI's stream has no
        ``response.cancelled`` (a cancelled stream just ends; ``response`` holds the object).
        ``completed_at`` is recorded for completed and incomplete responses only.
        """
        events = self._run()
        self._phase = "done"
        ok = finish.reason in ("eos", "stop_sequence")
        events += self._close("completed" if ok else "incomplete", tool_follows=False)
        self._response["usage"] = responses_usage(usage)
        if ok or finish.reason == "length":
            self._response["completed_at"] = completed_at
        if ok:
            self._response["status"] = "completed"
            return [*events, self._lifecycle("response.completed")]
        if finish.reason == "length":
            self._response["status"] = "incomplete"
            self._response["incomplete_details"] = {"reason": "max_output_tokens"}
            return [*events, self._lifecycle("response.incomplete")]
        if finish.reason == "error":
            self._response["status"] = "failed"
            self._response["error"] = {"code": "server_error", "message": finish.error or "generation failed"}
            return [*events, self._lifecycle("response.failed")]
        self._response["status"] = "cancelled"
        return events

    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type_, **fields, "sequence_number": self._seq}
        self._seq += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        return {**copy.deepcopy(self._response), "output": copy.deepcopy(self._items)}

    def _lifecycle(self, type_: str) -> dict[str, Any]:
        return self._event(type_, response=self._snapshot())

    def _run(self) -> list[dict[str, Any]]:
        if self._phase == "start" or self._phase == "done":
            raise ValueError(f"response not streaming ({self._phase})")
        if self._phase == "queued":
            self._phase = "running"
            self._response["status"] = "in_progress"
            return [self._lifecycle("response.in_progress")]
        return []

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._items[-1]["id"], "output_index": len(self._items) - 1}

    def _new_item(self, kind: str, **fields: Any) -> dict[str, Any]:
        item_id = f"{_PREFIXES[kind]}_{self._base}_{len(self._items)}"
        item = {"id": item_id, "type": kind, "status": "in_progress", **fields}
        self._items.append(item)
        self._open = True
        self._texts = []
        return self._event(
            "response.output_item.added", output_index=len(self._items) - 1, item=copy.deepcopy(item)
        )

    def _add_text_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            added = self._new_item("reasoning", summary=[], content=[])
        else:
            added = self._new_item("message", role="assistant", phase="final_answer", content=[])
        part = self._part("")
        return [
            added,
            self._event("response.content_part.added", **self._where(), content_index=0, part=part),
        ]

    def _add_call(self, start: ToolCallStart) -> list[dict[str, Any]]:
        self._call_index = start.index
        return [self._new_item("function_call", call_id=start.call_id, name=start.name, arguments="")]

    def _part(self, text: str) -> dict[str, Any]:
        if self._items[-1]["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}

    def _delta(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self._texts.append(text)
        kind = self._items[-1]["type"]
        if kind == "function_call":
            return [self._event("response.function_call_arguments.delta", **self._where(), delta=text)]
        if kind == "reasoning":
            return [
                self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)
            ]
        return [
            self._event(
                "response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[]
            )
        ]

    def _close(self, status: str, *, tool_follows: bool) -> list[dict[str, Any]]:
        """Closes the open item, if any: its ``.done`` events carry the full text."""
        if not self._open:
            return []
        self._open = False
        item, text, where = self._items[-1], "".join(self._texts), self._where()
        item["status"] = status
        events: list[dict[str, Any]] = []
        if item["type"] == "function_call":
            item["arguments"] = text
            events.append(self._event("response.function_call_arguments.done", **where, arguments=text))
        else:
            part = self._part(text)
            item["content"] = [part]
            if item["type"] == "message":
                if tool_follows:
                    item["phase"] = "commentary"
                done = self._event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                )
            else:
                done = self._event("response.reasoning_text.done", **where, content_index=0, text=text)
            events.append(done)
            part_done = self._event(
                "response.content_part.done", **where, content_index=0, part=copy.deepcopy(part)
            )
            events.append(part_done)
        done_item = self._event(
            "response.output_item.done", output_index=where["output_index"], item=copy.deepcopy(item)
        )
        return [*events, done_item]


_TERMINAL = ("response.completed", "response.incomplete", "response.failed")
_LIFECYCLE = ("response.created", "response.queued", "response.in_progress", *_TERMINAL)


class ResponsesAccumulator:
    """Rebuilds the response object from a ``ResponsesEncoder``'s events, in order.

    The lifecycle events give the response's fields; the output items are rebuilt from the item
    events (added, deltas, done) rather than copied, so the result shows what the deltas conveyed.
    Without a terminal event (a cancelled stream) the status stays what the stream last said.
    """

    def __init__(self) -> None:
        self._response: dict[str, Any] | None = None
        self._items: list[dict[str, Any]] = []
        self._texts: dict[int, list[str]] = {}

    def add(self, event: dict[str, Any]) -> None:
        type_ = event["type"]
        if type_ in _LIFECYCLE:
            self._response = copy.deepcopy(event["response"])
        elif type_ == "response.output_item.added":
            if event["output_index"] != len(self._items):
                raise ValueError(f"item added at {event['output_index']}, expected {len(self._items)}")
            self._items.append(copy.deepcopy(event["item"]))
            self._texts[event["output_index"]] = []
        elif type_.endswith(".delta"):
            self._texts[event["output_index"]].append(event["delta"])
        elif type_ == "response.output_item.done":
            self._items[event["output_index"]] = self._rebuilt(event)

    def result(self) -> dict[str, Any]:
        if self._response is None:
            raise ValueError("no lifecycle event accumulated")
        return {**copy.deepcopy(self._response), "output": copy.deepcopy(self._items)}

    def _rebuilt(self, event: dict[str, Any]) -> dict[str, Any]:
        """The done item, its text replaced by the concatenated deltas (they must agree)."""
        item: dict[str, Any] = copy.deepcopy(event["item"])
        text = "".join(self._texts[event["output_index"]])
        if item["type"] == "function_call":
            item["arguments"] = text
        elif item["type"] in ("message", "reasoning"):
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            if item["type"] == "message":
                part = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
            item["content"] = [part]
        return item
