"""OpenAI (legacy) Completions request body -> a validated ``CompletionRequest``. Pure.

One prompt per request: a string, or a list of token ids (a one-element list of either is
unwrapped). Several prompts in one request are a 400, as is ``suffix`` (no fill-in-the-middle
format); ``logit_bias`` is honoured as in Chat. ``logprobs`` here is OpenAI's integer 0-5: how
many top alternatives to return per token (0: just the sampled token's logprob). ``max_tokens``
defaults to 16, OpenAI's default for this endpoint. Chat's ``prompt_cache_key`` and
``prompt_cache_retention`` are accepted here too (OpenAI's legacy endpoint has neither), so one
client setting fits both. Given the model's vocabulary size, token ids it has no row for (in the
prompt or ``stop_token_ids``) are a 400 here, before anything decodes or embeds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from libs.recipe.api.common import (
    check_fields,
    include_usage,
    json_object,
    model_name,
    prompt_cache_retention,
    reject_present,
)
from libs.recipe.fields import ApiError, boolean, check_vocabulary, is_token_ids, optional_int, optional_str
from libs.recipe.sampling import MAX_N, Sampling, read_sampling

FIELDS = (
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens",
    "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
    "top_p", "user", "prompt_cache_key", "prompt_cache_retention",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",  # vLLM
)  # fmt: skip
UNSUPPORTED = {"suffix": "the served model has no fill-in-the-middle prompt format: send one prompt"}
MAX_LOGPROBS = 5  # OpenAI's limit for this endpoint
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]  # text to tokenize, or token ids used as they are
    echo: bool  # the response repeats the prompt before the completion
    sampling: Sampling
    stream: bool
    include_usage: bool
    cache_retention: str | None = None  # prompt_cache_retention as sent: the gateway maps it


def _is_one_prompt(value: Any) -> bool:
    return isinstance(value, str) or is_token_ids(value)


def _prompt(body: dict[str, Any]) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if is_token_ids(prompt) and prompt:
        return tuple(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and _is_one_prompt(prompt[0]):
        return _prompt({"prompt": prompt[0]})
    if isinstance(prompt, list) and len(prompt) > 1 and all(map(_is_one_prompt, prompt)):
        raise ApiError(
            400,
            "several prompts in one request are not supported: send one request per prompt",
            param="prompt",
        )
    if isinstance(prompt, list) and prompt and all(isinstance(i, int | float) for i in prompt):
        raise ApiError(400, "'prompt': token ids are integers in [0, 2**32)", param="prompt")
    raise ApiError(400, "'prompt' is required: a string or a non-empty list of token ids", param="prompt")


def parse_completion_request(body: Any, vocab_size: int | None = None) -> CompletionRequest:
    """Validate a Completions body (400 naming the offending field on bad input). With
    ``vocab_size``, every token id must be below it; without, any uint32 passes (the caller checks)."""
    body = json_object(body)
    check_fields(body, FIELDS, lambda key: f"Unrecognized request argument supplied: {key}")
    model = model_name(body)
    reject_present(body, UNSUPPORTED)
    logprobs = optional_int(body, "logprobs", 0, MAX_LOGPROBS)
    n = optional_int(body, "n", 1, MAX_N) or 1
    best_of = optional_int(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of not in (1, n):
        # best_of > n means sampling extra sequences and ranking them: not implemented.
        why = "'best_of' must be 1 or equal to 'n': ranking extra samples is not supported"
        raise ApiError(400, why, param="best_of")
    max_tokens = optional_int(body, "max_tokens", 1)
    prompt, echo = _prompt(body), boolean(body, "echo")
    sampling = read_sampling(
        body,
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
        n=n,
    )
    optional_str(body, "user")  # accepted, and unused
    if vocab_size is not None:
        if not isinstance(prompt, str):
            check_vocabulary(prompt, vocab_size, "prompt")
        check_vocabulary(sampling.base.stop_token_ids, vocab_size, "stop_token_ids")
        check_vocabulary([b.token_id for b in sampling.base.logit_bias], vocab_size, "logit_bias")
    return CompletionRequest(
        model=model,
        prompt=prompt,
        echo=echo,
        sampling=sampling,
        stream=boolean(body, "stream"),
        include_usage=include_usage(body),
        cache_retention=prompt_cache_retention(body),
    )
