"""ResponsesEncoder / ResponsesAccumulator: SDK-valid events, ordering invariants, body == stream."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from libs.recipe.events_responses import ResponsesAccumulator, ResponsesEncoder
from libs.recipe.segments import Content, Finish, Reasoning, Segment, ToolCallArgs, ToolCallStart
from tests.unit.recipe.events_helpers import THINK_SAY_CALL, USAGE

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
SKELETON: dict[str, Any] = {
    "id": "resp_abc",
    "created_at": 1700000000,
    "model": "m",
    "instructions": None,
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "temperature": 1.0,
    "top_p": 1.0,
    "store": False,
    "metadata": {},
}
FULL: list[Segment] = [*THINK_SAY_CALL, ToolCallArgs(1, "{}"), Content("Done.")]
SCRIPTS: dict[str, tuple[list[Segment], Finish, str, str]] = {
    "full": (FULL, Finish("eos"), "response.completed", "completed"),
    "length": ([Reasoning("r"), Content("Hel")], Finish("length"), "response.incomplete", "incomplete"),
    "error": (FULL[:6], Finish("error", error="worker died"), "response.failed", "failed"),
    "empty": ([], Finish("stop_sequence", "END"), "response.completed", "completed"),
}


def run(
    segments: list[Segment], finish: Finish, *, per_feed: int = 1, queued: bool = False
) -> tuple[ResponsesEncoder, list[dict[str, Any]]]:
    enc = ResponsesEncoder(SKELETON)
    events = enc.start(queued=queued)
    for i in range(0, len(segments), per_feed):
        events += enc.feed(segments[i : i + per_feed])
    events += enc.finish(finish, USAGE, 1700000009)
    return enc, events


def accumulate(events: list[dict[str, Any]]) -> dict[str, Any]:
    acc = ResponsesAccumulator()
    for event in events:
        acc.add(event)
    return acc.result()


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("per_feed", [1, 3, 100])
def test_sdk_accepts_events_and_body(name: str, per_feed: int) -> None:
    segments, finish, terminal, status = SCRIPTS[name]
    enc, events = run(segments, finish, per_feed=per_feed)
    for event in events:
        EVENTS.validate_python(event)
    assert events[-1]["type"] == terminal
    body = accumulate(events)
    assert body == events[-1]["response"] == enc.response  # what the stream conveyed, whole
    parsed = Response.model_validate(body)
    assert parsed.status == status
    assert parsed.usage is not None and parsed.usage.input_tokens_details.cached_tokens == 5


def test_full_output_items() -> None:
    _, events = run(FULL, Finish("eos"), per_feed=2)
    output = accumulate(events)["output"]
    assert [(i["id"], i["type"], i["status"]) for i in output] == [
        ("rs_abc_0", "reasoning", "completed"),
        ("msg_abc_1", "message", "completed"),
        ("fc_abc_2", "function_call", "completed"),
        ("fc_abc_3", "function_call", "completed"),
        ("msg_abc_4", "message", "completed"),
    ]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "Let me think"}]
    assert output[1]["content"][0]["text"] == "It is sunny."
    assert output[1]["phase"] == "commentary"  # a tool call followed: the text was a preamble
    assert output[4]["phase"] == "final_answer"
    assert (output[2]["call_id"], output[2]["name"], output[2]["arguments"]) == (
        "call_a",
        "get_weather",
        '{"city": "Paris"}',
    )
    assert output[3]["arguments"] == "{}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_event_order_invariants(name: str) -> None:
    segments, finish, _, _ = SCRIPTS[name]
    _, events = run(segments, finish)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    open_item: int | None = None
    open_part = False
    for event in events:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert open_item is None  # items never overlap
            open_item = event["output_index"]
        elif kind == "response.output_item.done":
            assert open_item == event["output_index"] and not open_part
            open_item = None
        elif kind == "response.content_part.added":
            assert open_item == event["output_index"] and not open_part
            open_part = True
        elif kind == "response.content_part.done":
            assert open_part
            open_part = False
        elif "output_index" in event:
            assert open_item == event["output_index"]
    assert open_item is None


def test_done_events_carry_the_full_text() -> None:
    _, events = run(FULL, Finish("eos"))
    done = {e["item_id"]: e for e in events if e["type"].endswith(("text.done", "arguments.done"))}
    assert done["rs_abc_0"]["text"] == "Let me think"
    assert done["msg_abc_1"]["text"] == "It is sunny."
    assert done["fc_abc_2"]["arguments"] == '{"city": "Paris"}'


def test_length_marks_the_open_item_incomplete() -> None:
    _, events = run([Reasoning("r"), Content("Hel")], Finish("length"))
    body = events[-1]["response"]
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["status"] for i in body["output"]] == ["completed", "incomplete"]
    assert body["completed_at"] == 1700000009


def test_error_fails_the_response() -> None:
    _, events = run(FULL[:3], Finish("error", error="worker died"))
    body = events[-1]["response"]
    assert body["error"] == {"code": "server_error", "message": "worker died"}
    assert body["completed_at"] is None


def test_abort_cancels_without_a_lifecycle_event() -> None:
    enc, events = run(FULL[:5], Finish("abort"))
    assert events[-1]["type"] == "response.output_item.done"
    assert events[-1]["item"]["status"] == "incomplete"
    assert enc.response["status"] == "cancelled"
    Response.model_validate(enc.response)
    assert accumulate(events)["output"] == enc.response["output"]


def test_queued_then_running() -> None:
    _, events = run([Content("hi")], Finish("eos"), queued=True)
    assert [e["type"] for e in events[:4]] == [
        "response.created",
        "response.queued",
        "response.in_progress",
        "response.output_item.added",
    ]
    assert events[0]["response"]["status"] == "queued"
    for event in events:
        EVENTS.validate_python(event)


def test_deterministic_and_skeleton_untouched() -> None:
    before = copy.deepcopy(SKELETON)
    _, first = run(FULL, Finish("eos"), per_feed=2)
    _, second = run(FULL, Finish("eos"), per_feed=2)
    assert first == second
    assert before == SKELETON  # the encoder works on its own copy


def test_misuse_is_refused() -> None:
    enc = ResponsesEncoder(SKELETON)
    with pytest.raises(ValueError):
        enc.feed([Content("before start")])
    enc.start()
    with pytest.raises(ValueError):
        enc.feed([ToolCallArgs(0, "{}")])
    enc.feed([ToolCallStart(0, "c", "f")])
    with pytest.raises(ValueError):
        enc.feed([ToolCallArgs(1, "{}")])
