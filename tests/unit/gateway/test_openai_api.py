from __future__ import annotations

import pytest

from services.gateway.openai_api import ApiError, ChunkWriter, parse_chat_request, usage

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
    assert (req.temperature, req.top_p, req.max_tokens, req.stream, req.stop) == (1.0, 1.0, None, False, [])


def test_max_completion_tokens_wins_and_stop_forms() -> None:
    req = parse_chat_request({**OK, "max_tokens": 5, "max_completion_tokens": 7, "stop": "x"})
    assert req.max_tokens == 7 and req.stop == ["x"]
    assert parse_chat_request({**OK, "stop": ["a", "b"]}).stop == ["a", "b"]


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"model": None}, "model"),
        ({"messages": None}, "messages"),
        ({"messages": [{"role": "user"}, 3]}, "messages[1]"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": True}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": 1}}, "stream_options"),
        ({"stop": ["a"] * 5}, "stop"),
        ({"n": 2}, "n"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"logprobs": True}, "logprobs"),
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


def test_vllm_extensions() -> None:
    req = parse_chat_request({**OK, "stop_token_ids": [7, 9], "ignore_eos": True, "seed": -3})
    assert (req.stop_token_ids, req.ignore_eos, req.seed) == ((7, 9), True, -3)


def test_shapes() -> None:
    writer = ChunkWriter("id1", "m", created=5)
    chunk = writer.chunk({"content": "x"})
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["delta"] == {"content": "x"}
    assert writer.usage_chunk(usage(3, 2))["choices"] == []
    done = writer.completion("hey", "stop", usage(3, 2))
    assert done["choices"][0]["message"] == {"role": "assistant", "content": "hey"}
    assert done["usage"]["total_tokens"] == 5
