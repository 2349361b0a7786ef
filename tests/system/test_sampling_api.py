"""Sampling parameters through the whole stack with the official SDK: n, seeds, logprobs, top_k,
penalties and logit_bias."""

from __future__ import annotations

import math

import openai
import pytest

from tests.system.stack import Stack

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Tell me a fact about cats."}]


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


def test_n_greedy_choices_share_the_prompt_and_agree(stack: Stack) -> None:
    sdk = client(stack)
    one = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12)
    three = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = {c.message.content for c in three.choices}
    assert texts == {one.choices[0].message.content}
    assert three.usage is not None and one.usage is not None
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_a_seed_reproduces_a_sampled_answer_and_choices_differ(stack: Stack) -> None:
    sdk = client(stack)

    def sample(seed: int, n: int = 1) -> list[str]:
        resp = sdk.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=1.0, top_p=0.95, seed=seed, max_tokens=24, n=n
        )
        return [c.message.content or "" for c in resp.choices]

    first = sample(1234)
    assert sample(1234) == first
    assert len(set(sample(1234, n=4))) > 1  # choice i runs with seed + i
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_logprobs_of_a_greedy_stream(stack: Stack) -> None:
    sdk = client(stack)
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            temperature=0,
            max_tokens=8,
            logprobs=True,
            top_logprobs=3,
            stream=True,
        )
    )
    entries = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []
    ]
    assert len(entries) == 8
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        # Greedy picks the most likely token, so its logprob is the best alternative's.
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.logprob <= 0.0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith(entries[0].token)


def test_top_k_one_is_greedy_and_penalties_change_the_answer(stack: Stack) -> None:
    sdk = client(stack)
    greedy = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    top1 = sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=24, extra_body={"top_k": 1}
    )
    assert top1.choices[0].message.content == greedy.choices[0].message.content
    penalised = sdk.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=24,
        frequency_penalty=2.0,
        presence_penalty=2.0,
    )
    assert penalised.choices[0].message.content != greedy.choices[0].message.content


def test_logit_bias_bans_and_forces_tokens(stack: Stack) -> None:
    from libs.modelfiles.registry import resolve_model_path
    from libs.recipe.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(resolve_model_path(), None)
    sdk = client(stack)
    ask = {
        "model": MODEL,
        "prompt": "The capital of France is",
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 0,
    }
    greedy = sdk.completions.create(**ask).choices[0]  # type: ignore[call-overload]
    assert greedy.logprobs is not None and greedy.logprobs.tokens
    first = greedy.logprobs.tokens[0]  # the token's text
    (first_id,) = tokenizer.encode(first, add_bos=False)
    banned = sdk.completions.create(**ask, logit_bias={str(first_id): -100}).choices[0]  # type: ignore[call-overload]
    assert banned.logprobs is not None and banned.logprobs.tokens
    assert first not in banned.logprobs.tokens and banned.text != greedy.text
    (dog,) = tokenizer.encode(" dog", add_bos=False)
    forced = sdk.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=4,
        logit_bias={str(dog): 100},
    )
    assert (forced.choices[0].message.content or "").split() == ["dog"] * 4
    # An id the model does not have is the client's mistake.
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
            logit_bias={str(10**6): 1},
        )
    assert raised.value.body["param"] == "logit_bias"  # type: ignore[index]
