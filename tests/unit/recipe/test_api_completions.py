"""Completions request model: one prompt (text or token ids), logprobs as a count, bad inputs."""

from __future__ import annotations

from typing import Any

import pytest

from libs.protocol.messages import TokenBias
from libs.recipe.api import parse_completion_request
from tests.unit.recipe.api_helpers import assert_names_field


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "Once", **fields}


def test_text_prompt_defaults() -> None:
    request = parse_completion_request(body())
    assert (request.prompt, request.echo, request.stream, request.sampling.max_tokens) == (
        "Once",
        False,
        False,
        16,
    )


@pytest.mark.parametrize(
    ("prompt", "expected"), [([1, 2, 3], (1, 2, 3)), (["one"], "one"), ([[4, 5]], (4, 5))]
)
def test_prompt_forms(prompt: Any, expected: Any) -> None:
    assert parse_completion_request(body(prompt=prompt)).prompt == expected


def test_logprobs_is_a_top_count() -> None:
    base = parse_completion_request(body(logprobs=3, echo=True, max_tokens=5)).sampling.base
    assert (base.logprobs, base.top_logprobs) == (True, 3)
    assert parse_completion_request(body(logprobs=0)).sampling.base.logprobs is True


def test_best_of_equal_to_n() -> None:
    assert parse_completion_request(
        body(n=2, best_of=2, stream=True, stream_options={"include_usage": True})
    ).include_usage


@pytest.mark.parametrize(
    ("request_body", "param", "fragment"),
    [
        (body(prompt=["a", "b"]), "prompt", "several prompts"),
        (body(prompt=[]), "prompt", "required"),
        (body(prompt=None), "prompt", "required"),
        (body(prompt=[1, 1e12]), "prompt", "token ids are integers in [0, 2**32)"),
        (body(prompt=[2**64]), "prompt", "token ids are integers"),
        (body(prompt=[-1, 3]), "prompt", "token ids are integers"),
        (body(suffix="x"), "suffix", "not supported"),
        (body(logit_bias={"1": 101}), "logit_bias", "[-100, 100]"),
        (body(logprobs=6), "logprobs", "between 0 and 5"),
        (body(best_of=3), "best_of", "equal to 'n'"),
        (body(messages=[]), "messages", "Unrecognized request argument supplied: messages"),
        (body(max_tokens=0), "max_tokens", "between 1"),
        (body(echo="yes"), "echo", "boolean"),
    ],
)
def test_bad_input(request_body: dict[str, Any], param: str, fragment: str) -> None:
    assert_names_field(parse_completion_request, request_body, param, fragment)


VOCAB = 100  # ids 0..99


def test_token_ids_inside_the_vocabulary_pass() -> None:
    request = parse_completion_request(body(prompt=[0, 99], stop_token_ids=[99], logit_bias={"99": 5}), VOCAB)
    assert request.prompt == (0, 99) and request.sampling.base.stop_token_ids == (99,)
    assert request.sampling.base.logit_bias == (TokenBias(99, 5.0),)
    assert parse_completion_request(body(prompt=[100]), None).prompt == (100,)  # the caller checks


@pytest.mark.parametrize(
    ("request_body", "param", "fragment"),
    [
        (body(prompt=[1, 100, 2]), "prompt", "token id 100"),
        (body(prompt=[[5, 2**32 - 1]]), "prompt", f"token id {2**32 - 1}"),
        (body(prompt=[100], echo=True), "prompt", "vocabulary"),
        (body(stop_token_ids=[7, 100]), "stop_token_ids", "token id 100"),
        (body(logit_bias={"7": 1, "100": -100}), "logit_bias", "token id 100"),
    ],
)
def test_token_ids_past_the_vocabulary_are_a_400(
    request_body: dict[str, Any], param: str, fragment: str
) -> None:
    assert_names_field(lambda b: parse_completion_request(b, VOCAB), request_body, param, fragment)
