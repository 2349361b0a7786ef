from __future__ import annotations

import pytest

from libs.protocol.messages import SamplingParams
from services.gateway.fields import ApiError
from services.gateway.openai_api import parse_chat_request
from services.gateway.responses import ChunkWriter, completion_choice, usage

OK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_defaults_and_content_parts() -> None:
    req = parse_chat_request(
        {
            **OK,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ],
        }
    )
    assert req.messages == [{"role": "user", "content": "ab"}]
    assert (req.stream, req.include_usage, req.sampling.max_tokens, req.sampling.stop) == (
        False,
        False,
        None,
        [],
    )
    assert req.sampling.resolve(9) == SamplingParams(max_tokens=9)


def test_max_completion_tokens_wins_and_stop_forms() -> None:
    req = parse_chat_request({**OK, "max_tokens": 5, "max_completion_tokens": 7, "stop": "x"})
    assert req.sampling.max_tokens == 7 and req.sampling.stop == ["x"]
    assert parse_chat_request({**OK, "stop": ["a", "b"]}).sampling.stop == ["a", "b"]


def test_every_sampling_field_reaches_the_params() -> None:
    body = {
        **OK,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": -0.5,
        "frequency_penalty": 2,
        "max_tokens": 20,
        "min_tokens": 20,
        "stop_token_ids": [7, 9],
        "ignore_eos": True,
        "seed": -3,
        "logprobs": True,
        "top_logprobs": 20,
        "n": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = parse_chat_request(body)
    assert req.stream and req.include_usage and req.sampling.n == 16
    assert req.sampling.resolve(20) == SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=-0.5,
        frequency_penalty=2.0,
        max_tokens=20,
        min_tokens=20,
        stop_token_ids=(7, 9),
        ignore_eos=True,
        seed=-3,
        logprobs=True,
        top_logprobs=20,
        n=16,
    )


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        ({"top_k": -1}, {"top_k": 0}),  # vLLM's "off"
        ({"top_k": 0, "top_p": 1, "temperature": 0}, {"top_k": 0, "top_p": 1.0, "temperature": 0.0}),
        (
            {"temperature": 2, "min_p": 1, "repetition_penalty": 2},
            {"temperature": 2.0, "min_p": 1.0, "repetition_penalty": 2.0},
        ),
        ({"logprobs": True}, {"logprobs": True, "top_logprobs": 0}),
        ({"logprobs": False, "top_logprobs": None, "n": None}, {"logprobs": False, "n": 1}),
    ],
)
def test_boundaries_and_null_mean_default(patch: dict[str, object], expected: dict[str, object]) -> None:
    params = parse_chat_request({**OK, **patch}).sampling.resolve(5)
    assert {key: getattr(params, key) for key in expected} == expected


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"model": None}, "model"),
        ({"messages": None}, "messages"),
        ({"messages": [{"role": "user"}, 3]}, "messages[1]"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": True}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 6, "max_tokens": 5}, "min_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": 1}}, "stream_options"),
        ({"stream_options": []}, "stream_options"),
        ({"stop": ["a"] * 5}, "stop"),
        ({"stop": 3}, "stop"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": True}, "n"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"seed": 2**64}, "seed"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"ignore_eos": "no"}, "ignore_eos"),
    ],
)
def test_invalid_fields_name_their_param(patch: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_chat_request({**OK, **patch})
    assert info.value.status == 400 and info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"
    assert param.split("[")[0] in info.value.message


def test_min_tokens_is_checked_against_the_resolved_max_tokens() -> None:
    sampling = parse_chat_request({**OK, "min_tokens": 10}).sampling
    assert sampling.resolve(10).min_tokens == 10
    with pytest.raises(ApiError) as info:
        sampling.resolve(9)  # the context window left room for only 9
    assert info.value.param == "min_tokens"


def test_shapes() -> None:
    writer = ChunkWriter("id1", "m", created=5)
    chunk = writer.chunk(2, {"content": "x"}, logprobs=[])
    assert chunk["object"] == "chat.completion.chunk" and "usage" not in chunk
    assert chunk["choices"] == [
        {"index": 2, "delta": {"content": "x"}, "logprobs": {"content": []}, "finish_reason": None}
    ]
    assert ChunkWriter("id1", "m", include_usage=True).chunk(0, {})["usage"] is None
    assert writer.usage_chunk(usage(3, 2))["choices"] == []
    done = writer.completion([completion_choice(0, "hey", "stop", None)], usage(3, 2))
    assert done["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hey"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert done["usage"]["total_tokens"] == 5 and (done["id"], done["created"]) == ("id1", 5)
