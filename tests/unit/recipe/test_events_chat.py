"""ChatEncoder / ChatAccumulator: OpenAI's SDK accepts every chunk and body; the body equals the stream."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from libs.recipe.events_chat import ChatAccumulator, ChatEncoder, chat_finish_reason
from libs.recipe.segments import Content, Finish, Reasoning, Segment, ToolCallArgs, ToolCallStart
from tests.unit.recipe.events_helpers import USAGE

THINK_TOOL: list[Segment] = [
    Reasoning("Let me"),
    Reasoning(" think"),
    Content("It is "),
    Content("sunny."),
    ToolCallStart(0, "call_00_a", "get_weather"),
    ToolCallArgs(0, '{"city": '),
    ToolCallArgs(0, '"Paris"}'),
    ToolCallStart(1, "call_01_b", "get_time"),
    ToolCallArgs(1, "{}"),
]
ONLY_TOOLS: list[Segment] = [ToolCallStart(0, "call_00_a", "f"), ToolCallArgs(0, '{"x": 1}')]
SCRIPTS: dict[str, tuple[list[Segment], Finish, str]] = {
    "think_tool": (THINK_TOOL, Finish("eos"), "tool_calls"),
    "only_tools": (ONLY_TOOLS, Finish("stop_sequence", "END"), "tool_calls"),
    "length_in_tool": (ONLY_TOOLS, Finish("length"), "length"),
    "text_length": ([Content("Hel"), Content("lo")], Finish("length"), "length"),
    "abort_in_tool": (ONLY_TOOLS, Finish("abort"), "stop"),
    "empty": ([], Finish("eos"), "stop"),
}


def run(
    segments: list[Segment], finish: Finish, *, per_feed: int = 1, logprobs: bool = False
) -> tuple[ChatEncoder, list[dict[str, Any]]]:
    enc = ChatEncoder("chatcmpl-1", "m", 1700000000, reasoning=True)
    chunks = enc.start(0)
    for i in range(0, len(segments), per_feed):
        entries = [{"token": "t", "logprob": -0.5, "bytes": [116], "top_logprobs": []}] if logprobs else None
        chunks += enc.feed(0, segments[i : i + per_feed], entries)
    chunks += enc.finish(0, finish)
    return enc, chunks


def accumulate(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    acc = ChatAccumulator()
    for chunk in chunks:
        acc.add(chunk)
    return acc.result()


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("per_feed", [1, 3, 100])
def test_sdk_accepts_stream_and_body(name: str, per_feed: int) -> None:
    segments, finish, reason = SCRIPTS[name]
    enc, chunks = run(segments, finish, per_feed=per_feed)
    chunks.append(enc.usage_chunk(USAGE))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    body = accumulate(chunks)
    completion = ChatCompletion.model_validate(body)
    assert completion.choices[0].finish_reason == reason
    assert completion.usage is not None
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 5
    assert body["usage"]["prompt_cache_miss_tokens"] == 7


@pytest.mark.parametrize("per_feed", [1, 2, 4, 100])
def test_body_is_what_the_stream_says(per_feed: int) -> None:
    _, chunks = run(THINK_TOOL, Finish("eos"), per_feed=per_feed)
    message = accumulate(chunks)["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "It is sunny.",
        "reasoning_content": "Let me think",
        "tool_calls": [
            {
                "id": "call_00_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "call_01_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    }


def test_tool_call_fragment_shapes() -> None:
    _, chunks = run(THINK_TOOL, Finish("eos"), per_feed=100)
    fragments = [
        c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["choices"][0]["delta"]
    ]
    first = [f for f in fragments if "id" in f]
    assert first == [
        {
            "index": 0,
            "id": "call_00_a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        },
        {
            "index": 1,
            "id": "call_01_b",
            "type": "function",
            "function": {"name": "get_time", "arguments": ""},
        },
    ]
    # Later fragments: only index + arguments; one feed's argument text for one call is merged.
    later = [f for f in fragments if "id" not in f]
    assert later == [
        {"index": 0, "function": {"arguments": '{"city": "Paris"}'}},
        {"index": 1, "function": {"arguments": "{}"}},
    ]


def test_only_tool_calls_give_null_content() -> None:
    _, chunks = run(ONLY_TOOLS, Finish("eos"))
    assert accumulate(chunks)["choices"][0]["message"]["content"] is None
    _, chunks = run([], Finish("eos"))
    assert accumulate(chunks)["choices"][0]["message"] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "",
    }


def test_first_and_last_chunks() -> None:
    _, chunks = run([Content("hi")], Finish("eos"))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "reasoning_content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert all(c["id"] == "chatcmpl-1" and c["created"] == 1700000000 for c in chunks)
    plain = ChatEncoder("x", "m", 1, reasoning=False)
    assert plain.start(0)[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_error_has_no_finish_chunk() -> None:
    enc = ChatEncoder("x", "m", 1, reasoning=False)
    enc.start(0)
    enc.feed(0, [Content("a")])
    assert enc.finish(0, Finish("error", error="boom")) == []
    with pytest.raises(ValueError):
        enc.feed(0, [Content("late")])


@pytest.mark.parametrize(
    ("reason", "tools", "expected"),
    [
        ("eos", False, "stop"),
        ("eos", True, "tool_calls"),
        ("stop_sequence", False, "stop"),
        ("stop_sequence", True, "tool_calls"),
        ("length", True, "length"),
        ("abort", True, "stop"),
        ("error", False, None),
    ],
)
def test_finish_mapping(reason: Any, tools: bool, expected: str | None) -> None:
    assert chat_finish_reason(Finish(reason), tools) == expected


def test_logprobs_held_back_ride_on_the_next_chunk() -> None:
    enc = ChatEncoder("x", "m", 1, reasoning=False)
    enc.start(0)
    entry = {"token": "a", "logprob": -1.0, "bytes": [97], "top_logprobs": []}
    assert enc.feed(0, [], [entry]) == []  # the parser held the text back: nothing to send yet
    chunk = enc.feed(0, [Content("ab")], [{**entry, "token": "b"}])[0]
    assert [e["token"] for e in chunk["choices"][0]["logprobs"]["content"]] == ["a", "b"]
    last = enc.feed(0, [], [{**entry, "token": "c"}]) + enc.finish(0, Finish("eos"))
    assert [e["token"] for e in last[-1]["choices"][0]["logprobs"]["content"]] == ["c"]
    ChatCompletionChunk.model_validate(chunk)


def test_logprobs_accumulate_in_order() -> None:
    _, chunks = run([Content("a"), Content("b"), Content("c")], Finish("eos"), logprobs=True)
    body = accumulate(chunks)
    assert len(body["choices"][0]["logprobs"]["content"]) == 3
    ChatCompletion.model_validate(body)


def test_n_choices_interleave_and_include_usage() -> None:
    enc = ChatEncoder("x", "m", 1, reasoning=False, n=2, include_usage=True)
    chunks = enc.start(0) + enc.start(1)
    chunks += enc.feed(1, [Content("B1")]) + enc.feed(0, [Content("A1")]) + enc.feed(1, [Content("B2")])
    chunks += enc.finish(1, Finish("length")) + enc.finish(0, Finish("eos"))
    assert all("usage" in c and c["usage"] is None for c in chunks)
    chunks.append(enc.usage_chunk(USAGE))
    body = accumulate(chunks)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "A1", "stop"),
        (1, "B1B2", "length"),
    ]
    with pytest.raises(ValueError):
        enc.start(2)


def test_misuse_is_refused() -> None:
    enc = ChatEncoder("x", "m", 1, reasoning=False)
    with pytest.raises(ValueError):
        enc.feed(0, [Content("before start")])
    enc.start(0)
    with pytest.raises(ValueError):
        enc.feed(0, [ToolCallArgs(3, "{}")])
    enc.feed(0, [ToolCallStart(0, "c", "f")])
    with pytest.raises(ValueError):
        enc.feed(0, [ToolCallStart(0, "c", "f")])
