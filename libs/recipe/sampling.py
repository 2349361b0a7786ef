"""Sampling fields -> SamplingParams: OpenAI's ranges plus vLLM's extensions. Pure.

``build_sampling`` takes values each API has already read and validated under its own names and
ranges; ``read_sampling`` reads the fields Chat and Completions spell alike, and ``parse_sampling``
is Chat's whole reader. vLLM's extra body fields read here: top_k (-1 means off, as 0 does), min_p,
repetition_penalty, min_tokens, stop_token_ids, ignore_eos. ``logit_bias`` (OpenAI's: a JSON
object from token ids, as strings, to a bias in [-100, 100]) is read here; the ids meet the
model's vocabulary in the gateway, as prompt token ids do. Stop strings stay in the gateway (they
are matched on text), so they are returned beside the params, not inside them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from libs.protocol.messages import SamplingParams, TokenBias
from libs.recipe.fields import INT32_MAX, INT64_MIN, ApiError, boolean, number, optional_int, shown, token_ids

MAX_STOP_STRINGS = 4
MAX_N = 16  # completions per request; each is a sequence with its own KV past the shared prompt
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_LOGIT_BIAS = 4096  # entries: each rides in every step message of the request's sequences
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 forces it


@dataclass(frozen=True, slots=True)
class Sampling:
    # Everything but max_tokens, which needs the prompt length: take the params from ``resolve``.
    base: SamplingParams
    max_tokens: int | None  # as asked; None means whatever the context window leaves
    stop: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return self.base.n

    def resolve(self, max_tokens: int) -> SamplingParams:
        """The params to submit, once the context window has fixed ``max_tokens``."""
        if self.base.min_tokens > max_tokens:
            raise ApiError(
                400,
                f"'min_tokens' ({self.base.min_tokens}) must not exceed max_tokens ({max_tokens})",
                param="min_tokens",
            )
        return dataclasses.replace(self.base, max_tokens=max_tokens)


def build_sampling(
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    min_tokens: int = 0,
    stop_token_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
    seed: int | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    n: int = 1,
    max_tokens: int | None = None,
    stop: Sequence[str] = (),
    logit_bias: tuple[TokenBias, ...] = (),
) -> Sampling:
    """Validated values -> Sampling (top_k <= 0 means off). The one check left is between fields:
    min_tokens > max_tokens fails here, before tokenizing, when max_tokens was asked for."""
    base = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),  # vLLM's -1 and our 0 both mean off
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        min_tokens=min_tokens,
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
        seed=seed,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        n=n,
        logit_bias=logit_bias,
    )
    sampling = Sampling(base, max_tokens, list(stop))
    if max_tokens is not None:
        sampling.resolve(max_tokens)
    return sampling


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP_STRINGS:
        return list(stop)
    raise ApiError(400, f"'stop' must be a string or up to {MAX_STOP_STRINGS} strings", param="stop")


def _max_tokens(body: dict[str, Any]) -> int | None:
    # max_completion_tokens is OpenAI's current name; max_tokens the deprecated one vLLM still reads.
    max_tokens = optional_int(body, "max_completion_tokens", 1)
    return max_tokens if max_tokens is not None else optional_int(body, "max_tokens", 1)


def _logit_bias(body: dict[str, Any]) -> tuple[TokenBias, ...]:
    """OpenAI's ``logit_bias``: {"token id": bias}, sorted by id (400 naming the field on a bad one)."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        message = f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids to biases"
        raise ApiError(400, message, param="logit_bias")
    entries: dict[int, float] = {}
    for key, bias in value.items():
        token_id = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else -1
        if not 0 <= token_id <= INT32_MAX:
            raise ApiError(400, f"'logit_bias' key {shown(key)} is not a token id", param="logit_bias")
        ok = isinstance(bias, int | float) and not isinstance(bias, bool) and math.isfinite(bias)
        if not ok or abs(bias) > MAX_ABS_LOGIT_BIAS:
            message = (
                f"'logit_bias' values must be numbers in [-100, 100]: token {token_id} has {shown(bias)}"
            )
            raise ApiError(400, message, param="logit_bias")
        if token_id in entries:  # "7" and "007"
            raise ApiError(400, f"'logit_bias' names token {token_id} twice", param="logit_bias")
        entries[token_id] = float(bias)
    return tuple(TokenBias(token_id, bias) for token_id, bias in sorted(entries.items()))


def _logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    logprobs = boolean(body, "logprobs")
    top_logprobs = optional_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise ApiError(400, "'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    return logprobs, top_logprobs or 0


def read_sampling(
    body: dict[str, Any], *, max_tokens: int | None, logprobs: bool, top_logprobs: int, n: int
) -> Sampling:
    """The sampling fields Chat and Completions spell alike, read from ``body`` (400 naming the
    field on a bad one); the ones they spell differently come read already."""
    return build_sampling(
        temperature=number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=optional_int(body, "top_k", -1, INT32_MAX) or 0,
        min_p=number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=number(body, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
        presence_penalty=number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        min_tokens=optional_int(body, "min_tokens", 0) or 0,
        stop_token_ids=token_ids(body, "stop_token_ids"),
        ignore_eos=boolean(body, "ignore_eos"),
        seed=optional_int(body, "seed", INT64_MIN),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        n=n,
        max_tokens=max_tokens,
        stop=_stop(body),
        logit_bias=_logit_bias(body),
    )


def parse_sampling(body: dict[str, Any]) -> Sampling:
    """Validate every sampling field of a Chat Completions body (400 naming the field on a bad one)."""
    logprobs, top_logprobs = _logprobs(body)
    return read_sampling(
        body,
        max_tokens=_max_tokens(body),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        n=optional_int(body, "n", 1, MAX_N) or 1,
    )
