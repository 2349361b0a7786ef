"""MessagesEncoder / MessagesAccumulator: SDK-valid events, block discipline, body == stream."""

from __future__ import annotations

from typing import Any

import pytest
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from libs.recipe.events_messages import MessagesAccumulator, MessagesEncoder, stop_reason, tool_input
from libs.recipe.segments import Content, Finish, Segment, ToolCallArgs, ToolCallStart, Usage
from tests.unit.recipe.events_helpers import THINK_SAY_CALL, USAGE

EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
FULL: list[Segment] = [*THINK_SAY_CALL, ToolCallArgs(1, "")]
SCRIPTS: dict[str, tuple[list[Segment], Finish, str]] = {
    "full": (FULL, Finish("eos"), "tool_use"),
    "stop_sequence": ([Content("Hel"), Content("lo ")], Finish("stop_sequence", "END"), "stop_sequence"),
    "length_in_tool": (FULL[:6], Finish("length"), "max_tokens"),
    "abort": (FULL[:3], Finish("abort"), "end_turn"),
    "empty": ([], Finish("eos"), "end_turn"),
}


def run(segments: list[Segment], finish: Finish, *, per_feed: int = 1) -> list[dict[str, Any]]:
    enc = MessagesEncoder("msg_1", "m", signature="sig")
    events = enc.start(Usage(12, 0, 5))
    for i in range(0, len(segments), per_feed):
        events += enc.feed(segments[i : i + per_feed])
    return events + enc.finish(finish, USAGE)


def accumulate(events: list[dict[str, Any]]) -> MessagesAccumulator:
    acc = MessagesAccumulator()
    for event in events:
        acc.add(event)
    return acc


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("per_feed", [1, 3, 100])
def test_sdk_accepts_events_and_body(name: str, per_feed: int) -> None:
    segments, finish, reason = SCRIPTS[name]
    events = run(segments, finish, per_feed=per_feed)
    for event in events:
        if event["type"] != "ping":  # ping is not in the SDK's union; clients skip it
            EVENTS.validate_python(event)
    message = Message.model_validate(accumulate(events).result())
    assert message.stop_reason == reason
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (7, 5)
    assert message.usage.output_tokens == 7


def test_body_is_what_the_stream_says() -> None:
    body = accumulate(run(FULL, Finish("eos"), per_feed=2)).result()
    assert body["content"] == [
        {"type": "thinking", "thinking": "Let me think", "signature": "sig"},
        {"type": "text", "text": "It is sunny."},
        {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_b", "name": "get_time", "input": {}},
    ]
    assert (body["id"], body["type"], body["role"], body["model"]) == ("msg_1", "message", "assistant", "m")
    assert body["stop_sequence"] is None


def test_message_start_usage() -> None:
    start = MessagesEncoder("msg_1", "m", signature="s").start(Usage(12, 0, 5))[0]
    assert start["message"]["usage"] == {
        "input_tokens": 7,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 5,
        "output_tokens": 0,
    }


@pytest.mark.parametrize("name", SCRIPTS)
def test_block_discipline(name: str) -> None:
    segments, finish, _ = SCRIPTS[name]
    events = run(segments, finish)
    assert events[0]["type"] == "message_start"
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    open_block: int | None = None
    started = 0
    kinds: dict[int, str] = {}
    for i, event in enumerate(events):
        if event["type"] == "content_block_start":
            assert open_block is None and event["index"] == started  # in order, never interleaved
            open_block, started = event["index"], started + 1
            kinds[event["index"]] = event["content_block"]["type"]
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_block
            if event["delta"]["type"] == "signature_delta":
                assert open_block is not None and kinds[open_block] == "thinking"
                assert events[i + 1] == {"type": "content_block_stop", "index": open_block}
        elif event["type"] == "content_block_stop":
            assert event["index"] == open_block
            open_block = None
    assert open_block is None
    assert [e["type"] for e in events].count("ping") == (1 if started else 0)
    if started:
        assert events[2]["type"] == "ping"  # right after the first block start


def test_stop_sequence_is_reported() -> None:
    events = run([Content("Hel")], Finish("stop_sequence", "END"))
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert accumulate(events).result()["stop_sequence"] == "END"


def test_error_is_an_error_event() -> None:
    enc = MessagesEncoder("msg_1", "m", signature="s")
    events = (
        enc.start(USAGE) + enc.feed([Content("partial")]) + enc.finish(Finish("error", error="oom"), USAGE)
    )
    assert events[-1] == {"type": "error", "error": {"type": "api_error", "message": "oom"}}
    ErrorResponse.model_validate(events[-1])
    acc = accumulate(events)
    assert acc.error == {"type": "api_error", "message": "oom"}
    assert acc.result()["stop_reason"] is None
    with pytest.raises(ValueError):
        enc.feed([Content("late")])


@pytest.mark.parametrize(
    ("finish", "tools", "expected"),
    [
        (Finish("eos"), False, ("end_turn", None)),
        (Finish("eos"), True, ("tool_use", None)),
        (Finish("stop_sequence", "X"), False, ("stop_sequence", "X")),
        (Finish("stop_sequence", "X"), True, ("tool_use", None)),
        (Finish("length"), True, ("max_tokens", None)),
        (Finish("abort"), True, ("end_turn", None)),
    ],
)
def test_stop_reason_mapping(finish: Finish, tools: bool, expected: tuple[str, str | None]) -> None:
    assert stop_reason(finish, tools) == expected


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('{"a": [1, 2]}', {"a": [1, 2]}),
        ("", {}),
        ("  ", {}),
        ('{"a": ', {"arguments": '{"a": '}),  # cut off: kept whole, not dropped
        ("[1]", {"arguments": "[1]"}),  # not an object
    ],
)
def test_tool_input(arguments: str, expected: dict[str, Any]) -> None:
    assert tool_input(arguments) == expected


def test_truncated_tool_call_body_is_valid() -> None:
    body = accumulate(run(FULL[:6], Finish("length"))).result()
    assert body["content"][-1]["input"] == {"arguments": '{"city": '}
    Message.model_validate(body)


def test_misuse_is_refused() -> None:
    enc = MessagesEncoder("msg_1", "m", signature="s")
    with pytest.raises(ValueError):
        enc.feed([Content("before start")])
    enc.start(USAGE)
    with pytest.raises(ValueError):
        enc.feed([ToolCallArgs(0, "{}")])
    enc.feed([ToolCallStart(0, "c", "f"), Content("after")])
    with pytest.raises(ValueError):
        enc.feed([ToolCallArgs(0, "{}")])  # its block is closed: blocks never reopen
