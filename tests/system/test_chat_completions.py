"""Chat Completions end to end: HTTP -> gateway -> NATS -> scheduler -> worker -> JetStream -> SSE."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.system.stack import Stack

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
    "What is 2 + 3?",
    "Give me a synonym for happy.",
    "Which planet is closest to the sun?",
    "Say hello in Spanish.",
    "What do bees make?",
]


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


def chat(stack: Stack, prompt: str, max_tokens: int, stream: bool = False) -> tuple[str, str | None, dict]:  # type: ignore[type-arg]
    """(text, finish_reason, usage) through the official SDK."""
    messages = [{"role": "user", "content": prompt}]
    sdk = client(stack)
    if not stream:
        resp = sdk.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens
        )
        assert resp.usage is not None
        return resp.choices[0].message.content or "", resp.choices[0].finish_reason, resp.usage.model_dump()
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    return text, finish[0], chunks[-1].usage.model_dump()


def test_greedy_answer_is_paris(stack: Stack) -> None:
    text, finish, _ = chat(stack, "What is the capital of France?", max_tokens=30)
    assert "Paris" in text
    assert finish == "stop"


def test_sdk_stream_equals_non_stream_and_usage(stack: Stack) -> None:
    text, finish, usage = chat(stack, "Tell me about the moon.", max_tokens=12)
    s_text, s_finish, s_usage = chat(stack, "Tell me about the moon.", max_tokens=12, stream=True)
    assert text == s_text and finish == s_finish == "length"
    # The second request finds every full block of the same prompt in the prefix cache (16-token
    # blocks; the block holding the last prompt token is always computed).
    cached = s_usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == (s_usage["prompt_tokens"] - 1) // 16 * 16 > 0
    assert s_usage["prompt_cache_hit_tokens"] == cached
    assert s_usage["prompt_cache_miss_tokens"] == s_usage["prompt_tokens"] - cached
    cache_fields = ("prompt_tokens_details", "prompt_cache_hit_tokens", "prompt_cache_miss_tokens")
    assert {k: v for k, v in usage.items() if k not in cache_fields} == {
        k: v for k, v in s_usage.items() if k not in cache_fields
    }
    assert usage["completion_tokens"] == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12
    # The rendered ChatML prompt: default system prompt + the user turn + the assistant header.
    assert 30 < usage["prompt_tokens"] < 45


def test_usage_matches_the_tokenizer(stack: Stack) -> None:
    from libs.modelfiles.registry import resolve_model_path
    from libs.recipe.chat_template import ChatTemplate
    from libs.recipe.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(resolve_model_path(), None)
    assert tok.chat_template is not None
    prompt = ChatTemplate(tok.chat_template).render([{"role": "user", "content": "Hi there"}])
    text, finish, usage = chat(stack, "Hi there", max_tokens=40)
    assert usage["prompt_tokens"] == len(tok.encode(prompt))
    if finish == "stop":  # the text plus the end-of-turn token
        assert usage["completion_tokens"] == len(tok.encode(text)) + 1


def test_concurrent_streams_each_equal_their_solo_run(stack: Stack) -> None:
    solo = [chat(stack, p, max_tokens=20)[0] for p in PROMPTS]

    async def stream_one(http: httpx.AsyncClient, prompt: str) -> str:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": 20,
            "stream": True,
        }
        pieces = []
        async with http.stream("POST", "/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    pieces.append(chunk["choices"][0]["delta"].get("content") or "")
        return "".join(pieces)

    async def run_all() -> list[str]:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
            return await asyncio.gather(*(stream_one(http, p) for p in PROMPTS))

    together = asyncio.run(run_all())
    assert len(set(solo)) == len(PROMPTS)  # different prompts, different answers
    assert together == solo


def test_models_and_health(stack: Stack) -> None:
    models = httpx.get(f"{stack.base_url}/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(f"{stack.root_url}/health").status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        ({"model": MODEL}, 400, "messages"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "messages": "hi"}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            400,
            "temperature",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": -0.5},
            400,
            "temperature",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
            400,
            "max_tokens",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"},
            400,
            "max_tokens",
        ),
        ({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
        ([1, 2], 400, None),
    ],
)
def test_bad_input_gets_openai_error_and_service_continues(
    stack: Stack, body: object, status: int, param: str | None
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(
        f"{stack.base_url}/chat/completions", content=content, headers={"content-type": "application/json"}
    )
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if status == 404:
        assert error["code"] == "model_not_found"
    text, _, _ = chat(stack, "What is the capital of France?", max_tokens=8)
    assert "Paris" in text


def test_stop_string_cuts_the_answer_in_both_modes(stack: Stack) -> None:
    sdk = client(stack)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    resp = sdk.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=30, stop=["Paris"]
    )
    chunks = sdk.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=30, stop=["Paris"], stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert resp.choices[0].message.content == streamed == "The capital of France is "
    assert resp.choices[0].finish_reason == "stop"


def test_stop_token_ids_and_ignore_eos(stack: Stack) -> None:
    """vLLM's extra body fields: the greedy answer is 'The capital of France is Paris.' + EOS."""
    sdk = client(stack)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    longer = sdk.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert longer.choices[0].finish_reason == "length" and longer.usage is not None
    assert longer.usage.completion_tokens == 12
    assert (longer.choices[0].message.content or "").startswith("The capital of France is Paris.")
    from libs.modelfiles.registry import resolve_model_path
    from libs.recipe.tokenizer import Tokenizer

    (france,) = Tokenizer.from_gguf(resolve_model_path(), None).encode(" France")
    cut = sdk.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=12, extra_body={"stop_token_ids": [france]}
    )
    assert cut.choices[0].finish_reason == "stop" and cut.usage is not None
    assert cut.usage.completion_tokens == 4  # "The", " capital", " of", " France"


def test_a_predicted_output_is_verified_and_counted_in_usage(stack: Stack) -> None:
    """OpenAI Predicted Outputs: the prediction's tokens are drafts the worker verifies, so the
    text is what it is without one; usage says how many of them ended in the output."""
    sdk = client(stack)
    messages = [
        {"role": "user", "content": "Write a Python function that returns the sum of a list of numbers."}
    ]
    plain = sdk.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32)
    text = plain.choices[0].message.content or ""
    assert plain.usage is not None and plain.usage.completion_tokens_details is not None
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    for content in (text, "def add(a, b):\n    return a + b\n" + text[:20]):
        chunks = sdk.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=32,
            prediction={"type": "content", "content": content},
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(chunks)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens_details is not None
        details = usage.completion_tokens_details
        assert (
            details.accepted_prediction_tokens is not None and details.rejected_prediction_tokens is not None
        )
        if content == text:  # almost all of it is drafted, and right
            assert details.accepted_prediction_tokens >= 20 > details.rejected_prediction_tokens
        else:  # its start is found after the unrelated function; the drafts past that are wrong
            assert details.rejected_prediction_tokens > 0
        assert usage.completion_tokens == 32


def test_nothing_past_a_stop_is_sent_when_it_falls_inside_accepted_drafts(stack: Stack) -> None:
    """A prediction that runs past the stop: its drafts are accepted beyond the stop string and
    the stop token, and still neither the text nor the usage goes past them."""
    sdk = client(stack)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prediction = {"type": "content", "content": "The capital of France is Paris. It is a city of art."}
    for stream in (False, True):
        resp = sdk.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=30,
            stop=["Paris"],
            prediction=prediction,
            stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )
        if stream:
            chunks = list(resp)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            usage = chunks[-1].usage
        else:
            text, finish, usage = resp.choices[0].message.content, [resp.choices[0].finish_reason], resp.usage
        assert text == "The capital of France is " and finish == ["stop"]
        assert usage is not None and usage.completion_tokens_details is not None
        assert (usage.completion_tokens_details.accepted_prediction_tokens or 0) >= 4
    from libs.modelfiles.registry import resolve_model_path
    from libs.recipe.tokenizer import Tokenizer

    (france,) = Tokenizer.from_gguf(resolve_model_path(), None).encode(" France")
    cut, plain = (
        sdk.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=12,
            extra_body={"stop_token_ids": [france], **extra},
        )
        for extra in ({"prediction": prediction}, {})
    )
    assert cut.choices[0].message.content == plain.choices[0].message.content
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage is not None and cut.usage.completion_tokens == 4  # " France" ends it
    assert cut.usage.completion_tokens_details is not None
    assert (cut.usage.completion_tokens_details.accepted_prediction_tokens or 0) >= 3
