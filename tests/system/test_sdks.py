"""The official openai and anthropic SDKs, unmodified, against the running stack (SmolLM2, fp32)."""

from __future__ import annotations

import time
from typing import Any

import anthropic
import openai
import pytest

from tests.system.stack import Stack

MODEL = "SmolLM2-135M-Instruct"
ASK = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def oai(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(stack: Stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.root_url, api_key="unused", max_retries=0, timeout=120)


def test_chat_stream_equals_non_stream(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": ASK}]
    whole = oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)  # type: ignore[arg-type]
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and "Paris" in text
    assert chunks[-1].usage is not None
    # The same prompt twice: the second finds its full blocks in the prefix cache.
    cache_fields = {"prompt_tokens_details", "prompt_cache_hit_tokens", "prompt_cache_miss_tokens"}
    assert chunks[-1].usage.model_dump(exclude=cache_fields) == whole.usage.model_dump(exclude=cache_fields)
    assert chunks[-1].usage.prompt_tokens_details is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_completions(oai: openai.OpenAI) -> None:
    ask = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    done = oai.completions.create(**ask, logprobs=2, echo=True)  # type: ignore[call-overload]
    streamed = list(oai.completions.create(**ask, logprobs=2, stream=True))  # type: ignore[call-overload]
    choice = done.choices[0]
    assert choice.text == ask["prompt"] + "".join(c.choices[0].text for c in streamed)
    assert done.usage is not None and done.usage.completion_tokens == 8
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == 8 and all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset is not None and lp.text_offset[0] == len(ask["prompt"])  # after the echo
    streamed_tokens = [
        t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []
    ]
    assert streamed_tokens == lp.tokens


def test_responses_create_stream_retrieve_and_chain(oai: openai.OpenAI) -> None:
    first = oai.responses.create(model=MODEL, input=ASK, temperature=0, max_output_tokens=24)
    assert first.status in ("completed", "incomplete") and "Paris" in first.output_text
    assert oai.responses.retrieve(first.id).output_text == first.output_text

    events = list(
        oai.responses.create(model=MODEL, input=ASK, temperature=0, max_output_tokens=24, stream=True)
    )
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    order = ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert [t for t in types if t in order][:3] == order
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == first.output_text

    # previous_response_id: the follow-up's prompt holds the first exchange (a longer input).
    follow = oai.responses.create(
        model=MODEL, input="And of Italy?", previous_response_id=first.id, temperature=0, max_output_tokens=16
    )
    alone = oai.responses.create(model=MODEL, input="And of Italy?", temperature=0, max_output_tokens=16)
    assert follow.usage is not None and alone.usage is not None
    assert follow.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens  # type: ignore[union-attr]


def test_responses_background_and_cancel(oai: openai.OpenAI) -> None:
    started = oai.responses.create(
        model=MODEL, input="Write a long story about a dragon.", max_output_tokens=400, background=True
    )
    assert started.status in ("queued", "in_progress")
    cancelled = oai.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert oai.responses.retrieve(started.id).status == "cancelled"

    quick = oai.responses.create(model=MODEL, input=ASK, temperature=0, max_output_tokens=12, background=True)
    deadline = time.monotonic() + 60
    while (got := oai.responses.retrieve(quick.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert got.status in ("completed", "incomplete") and "Paris" in got.output_text


def test_bad_requests_get_each_apis_error_shape(oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    with pytest.raises(openai.BadRequestError) as chat_err:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])  # type: ignore[misc,list-item]
    assert chat_err.value.body["param"] == "messages[0].role"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(
            model=MODEL, input=[{"type": "function_call_output", "call_id": "x", "output": "1"}]
        )
    with pytest.raises(anthropic.BadRequestError) as msg_err:
        claude.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [{"type": "wat"}]}]
        )  # type: ignore[list-item]
    assert msg_err.value.body["type"] == "error"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve("resp_does_not_exist")
    # and the service keeps serving
    assert oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )


def test_messages_stream_non_stream_and_count_tokens(claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": ASK}]
    greedy = {"temperature": 0}  # this SDK version has no temperature argument
    whole = claude.messages.create(model=MODEL, max_tokens=24, messages=messages, extra_body=greedy)  # type: ignore[arg-type]
    assert whole.content[0].type == "text" and "Paris" in whole.content[0].text
    with claude.messages.stream(model=MODEL, max_tokens=24, messages=messages, extra_body=greedy) as stream:  # type: ignore[arg-type]
        types = [event.type for event in stream]
        final = stream.get_final_message()
    assert [b.model_dump(include={"type", "text"}) for b in final.content] == [
        b.model_dump(include={"type", "text"}) for b in whole.content
    ]
    assert final.stop_reason == whole.stop_reason
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert (
        types.index("content_block_start")
        < types.index("content_block_delta")
        < types.index("content_block_stop")
        < types.index("message_delta")
    )
    counted = claude.messages.count_tokens(model=MODEL, messages=messages)  # type: ignore[arg-type]
    # Messages' input_tokens leaves out what was read from the cache
    assert counted.input_tokens == whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_forced_tool_call_streams_as_it_completes(oai: openai.OpenAI) -> None:
    """tool_choice=required: the prompt opens the call, the parser reads it; streamed fragments
    concatenate to the non-streamed call. (Without a grammar the tiny model's arguments need not
    be valid JSON; constrained decoding is what guarantees that.)"""
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 40,
    }
    whole = oai.chat.completions.create(**ask)  # type: ignore[call-overload]
    [call] = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason in ("tool_calls", "length") and call.function.name
    names, arguments, ids = [], [], []
    for chunk in oai.chat.completions.create(**ask, stream=True):  # type: ignore[call-overload]
        for delta in chunk.choices[0].delta.tool_calls or []:
            assert delta.index == 0
            ids += [delta.id] if delta.id else []
            names += [delta.function.name] if delta.function.name else []
            arguments.append(delta.function.arguments or "")
    assert names == [call.function.name] and len(ids) == 1  # the name and id come once, first
    assert "".join(arguments) == call.function.arguments


def test_responses_background_stream_resumes_with_starting_after(oai: openai.OpenAI) -> None:
    ask = {"model": MODEL, "input": ASK, "temperature": 0, "max_output_tokens": 24, "background": True}
    first = []
    with oai.responses.create(**ask, stream=True) as stream:  # type: ignore[call-overload]
        for event in stream:
            first.append(event)
            if len(first) == 5:
                break  # the client goes away; a background response runs on
    response_id = first[0].response.id
    rest = list(oai.responses.retrieve(response_id, stream=True, starting_after=first[-1].sequence_number))
    whole = list(oai.responses.retrieve(response_id, stream=True))
    assert [e.sequence_number for e in first + rest] == list(range(len(whole)))
    assert [e.type for e in first + rest] == [e.type for e in whole]
    assert whole[0].type == "response.created" and whole[1].type == "response.queued"
    assert whole[-1].type in ("response.completed", "response.incomplete")


def test_fields_for_the_vendors_own_service_are_accepted_and_change_no_answer(
    oai: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    """Regions, tiers, moderation scoring, cache options, compaction: inert here (greedy, the same text)."""
    messages = [{"role": "user", "content": ASK}]
    chat: dict[str, Any] = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 12}
    steered = oai.chat.completions.create(
        **chat,
        moderation={"model": "omni-moderation-latest", "policy": {"input": {"mode": "score"}}},
        prompt_cache_options={"mode": "explicit", "ttl": "30m"},
        service_tier="flex",
        safety_identifier="user-1",
        verbosity="low",
        store=True,
    )
    assert (
        steered.choices[0].message.content == oai.chat.completions.create(**chat).choices[0].message.content
    )

    responses: dict[str, Any] = {"model": MODEL, "input": ASK, "temperature": 0, "max_output_tokens": 12}
    steered_response = oai.responses.create(
        **responses,
        context_management=[{"type": "compaction", "compact_threshold": 100_000}],
        access_programs={"cyber": "standard"},
        background_options={"completion_window": "soonest"},
        image={"context_compression": "auto"},
        prompt_cache_options={"mode": "implicit", "ttl": "12h"},
    )
    assert steered_response.output_text == oai.responses.create(**responses).output_text

    # extra_body: this SDK version has no temperature argument
    message: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "messages": messages}
    message["extra_body"] = {"temperature": 0}
    whole = claude.messages.create(**message)
    cached = claude.messages.create(
        **message,
        cache_control={"type": "ephemeral", "ttl": "1h"},  # the default retention class
        speed="fast",
        inference_geo="us",
        diagnostics={"previous_message_id": whole.id},
        service_tier="standard_only",
        workspace_id="wrkspc_1",  # a header: the gateway has no workspaces
    )
    assert [b.model_dump() for b in cached.content] == [b.model_dump() for b in whole.content]


def test_refused_fields_say_why_in_each_apis_error_shape(
    oai: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    with pytest.raises(anthropic.BadRequestError) as msg_err:
        claude.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}], container="container_1"
        )
    error = msg_err.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error"
    assert "'container' is not supported: no code execution containers" in error["message"]
    with pytest.raises(openai.BadRequestError) as resp_err:
        oai.responses.create(model=MODEL, input="hi", conversation="conv_1")
    assert resp_err.value.body["param"] == "conversation"  # type: ignore[index]
    assert "previous_response_id" in resp_err.value.body["message"]  # type: ignore[index]
