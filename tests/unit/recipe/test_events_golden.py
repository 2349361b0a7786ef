"""Golden streams: our encoders fed by hand the segments deepseek-recipe's parser finds in the same text.

The oracle wheel (test-only) parses raw model text and emits events; we feed our encoders the
equivalent segments one per ``feed`` (as the wheel emits one event per parsed piece) and compare
whole events after normalising what legitimately differs: random tool-call ids (we reuse the
wheel's), timestamps, Chat usage placement (the wheel puts it on the final chunk; we follow
OpenAI's separate chunk), null-vs-absent delta keys, and a few extra fields on either side.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from libs.recipe.events_chat import ChatEncoder
from libs.recipe.events_messages import MessagesEncoder
from libs.recipe.events_responses import ResponsesEncoder
from libs.recipe.segments import Content, Finish, Reasoning, Segment, ToolCallArgs, ToolCallStart, Usage

dr = pytest.importorskip("deepseek_recipe")

MODEL = "DeepSeek-V4.1-Flash"
TOOL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
# Appendix A of the recipe spec: reasoning, a split </think>, content, one DSML tool call.
TOOL_TEXT = [
    "Let me",
    " think",
    "</th",
    "ink>",
    "It is ",
    "sunny.",
    '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_',
    'weather">\n<｜DSML｜ parameter name="city" string="true">Par',
    'is</｜DSML｜ parameter>\n<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n</｜DSML｜ calls>",
]
ARG_PIECES = ["{", '"city"', ": ", '"', "Par", "is", '"', ", ", '"days"', ": ", "3", "}"]


def tool_segments(call_id: str) -> list[Segment]:
    head: list[Segment] = [Reasoning("Let me"), Reasoning(" think"), Content("It is "), Content("sunny.")]
    return [*head, ToolCallStart(0, call_id, "get_weather"), *(ToolCallArgs(0, p) for p in ARG_PIECES)]


# (name, text chunks, backend finish, thinking, extra request fields, our segments, our finish, usage)
CASES: list[tuple[str, list[str], str, bool, dict[str, Any], list[Segment] | None, Finish, Usage]] = [
    ("tools", TOOL_TEXT, "Stop", True, {}, None, Finish("eos"), Usage(10, 9, 4)),
    (
        "length",
        ["Hello", " wor"],
        "Length",
        False,
        {},
        [Content("Hello"), Content(" wor")],
        Finish("length"),
        Usage(10, 2, 4),
    ),
    (
        "stop_sequence",
        ["Hel", "lo EN", "D more"],
        "Stop",
        False,
        {"stop": ["END"]},
        [Content("Hel"), Content("lo ")],
        Finish("stop_sequence", "END"),
        Usage(10, 3, 4),
    ),
]


def oracle(api: str, chunks: list[str], finish: str, thinking: bool, extra: dict[str, Any]) -> list[Any]:
    """The wheel's events for ``chunks`` (10 prompt tokens, 4 cached), as dicts."""
    function: dict[str, Any] = {"name": "get_weather", "parameters": TOOL_SCHEMA}
    tools = [{"type": "function", "function": function}]
    body: dict[str, Any]
    if api == "chat":
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools, **extra}
        body["thinking"] = {"type": "enabled" if thinking else "disabled"}
        conv = dr.ChatCompletionRequest(body).convert(dr.ConversionOptions())
        gen = dr.ChatCompletionRequest.chunk_generator(conv, "cid", "m")
    elif api == "responses":
        body = {"model": MODEL, "input": "hi", "tools": [{"type": "function", **function}]}
        body["reasoning"] = {"effort": "high" if thinking else "none"}
        conv = dr.ResponsesRequest(body).convert(dr.ConversionOptions())
        gen = dr.ResponsesRequest.chunk_generator(conv, "rid", "m")
    else:
        anthropic_tools = [{"name": "get_weather", "input_schema": TOOL_SCHEMA}]
        body = {"model": MODEL, "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
        body.update(tools=anthropic_tools, thinking={"type": "enabled" if thinking else "disabled"})
        if "stop" in extra:
            body["stop_sequences"] = extra["stop"]
        conv = dr.MessagesRequest(body).convert(dr.ConversionOptions())
        gen = dr.MessagesRequest.chunk_generator(conv, "mid", "m")
    processor = dr.StreamProcessor(gen, conv.parsing_options)
    usage = dr.PromptUsage(prompt_tokens=10, prompt_cache_hit_tokens=4)
    out = list(processor.push(dr.InferenceChunk.ready(prompt_usage=usage)))
    for chunk in chunks:
        if not processor.finished:
            out += processor.push(dr.InferenceChunk.text(chunk, 1))
    if not processor.finished:
        out += processor.push(dr.InferenceChunk.finish(getattr(dr.InferenceFinishReason, finish)))
    out += processor.finish()
    return [json.loads(event.to_json()) for event in out]


def call_ids(events: list[dict[str, Any]]) -> list[str]:
    """The wheel's random tool-call ids, in order, wherever its API puts them."""
    return list(dict.fromkeys(re.findall(r"call_\d\d_[A-Za-z0-9]+", json.dumps(events))))


def segments_for(case_segments: list[Segment] | None, wheel: list[dict[str, Any]]) -> list[Segment]:
    return case_segments if case_segments is not None else tool_segments(call_ids(wheel)[0])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_chat_matches_wheel(case: Any) -> None:
    _, chunks, backend_finish, thinking, extra, segs, finish, usage = case
    wheel = oracle("chat", chunks, backend_finish, thinking, extra)
    enc = ChatEncoder("cid", "m", 7, reasoning=thinking)
    ours = enc.start(0)
    for segment in segments_for(segs, wheel):
        ours += enc.feed(0, [segment])
    ours += enc.finish(0, finish)
    wheel_usage = wheel[-1].pop("usage")

    def norm(chunk: dict[str, Any]) -> dict[str, Any]:
        choice = dict(chunk["choices"][0])
        # The wheel spells absent as null (and the first chunk's content as null); both mean "nothing".
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v not in (None, "")}
        return {"id": chunk["id"], "object": chunk["object"], "model": chunk["model"], "choices": [choice]}

    assert [norm(c) for c in ours] == [norm(c) for c in wheel]
    ours_usage = enc.usage_chunk(usage)["usage"]
    assert {k: ours_usage[k] for k in wheel_usage} == wheel_usage


# The Responses API has no stop sequences.
@pytest.mark.parametrize("case", [c for c in CASES if "stop" not in c[4]], ids=["tools", "length"])
def test_responses_matches_wheel(case: Any) -> None:
    _, chunks, backend_finish, thinking, extra, segs, finish, usage = case
    wheel = oracle("responses", chunks, backend_finish, thinking, extra)
    terminal = wheel[-1]["response"]
    enc = ResponsesEncoder(wheel[0]["response"])  # the wheel's echoed settings as our skeleton
    ours = enc.start()
    for segment in segments_for(segs, wheel):
        ours += enc.feed([segment])
    ours += enc.finish(finish, usage, terminal["completed_at"])

    def norm(event: dict[str, Any]) -> dict[str, Any]:
        text = json.dumps(event)
        event = json.loads(text)
        for item in [event.get("item"), *(event.get("response") or {}).get("output", [])]:
            if item:
                item.pop("encrypted_content", None)  # the wheel's opaque token; we send none
        usage_ = (event.get("response") or {}).get("usage")
        if usage_:
            usage_["input_tokens_details"].pop("cache_write_tokens", None)  # newer SDK field we add
        return dict(event)

    assert [norm(e) for e in ours] == [norm(e) for e in wheel]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_messages_matches_wheel(case: Any) -> None:
    _, chunks, backend_finish, thinking, extra, segs, finish, usage = case
    wheel = oracle("messages", chunks, backend_finish, thinking, extra)
    enc = MessagesEncoder("mid", "m", signature="mid")  # the wheel signs with the message id
    ours = enc.start(usage)
    for segment in segments_for(segs, wheel):
        ours += enc.feed([segment])
    ours += enc.finish(finish, usage)

    def norm(event: dict[str, Any]) -> dict[str, Any]:
        event = json.loads(json.dumps(event))
        for holder in (event, event.get("message") or {}):
            if "usage" in holder:
                holder["usage"].pop("service_tier", None)  # the wheel's constant "standard"
        return dict(event)

    assert [norm(e) for e in ours] == [norm(e) for e in wheel]
