"""OpenAI Chat Completions: request validation and response shapes. Pure: dicts in, dicts out.

Errors are ``ApiError`` carrying the HTTP status and OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOP_STRINGS = 4
# Fields we accept but do not support yet: refusing beats silently ignoring them.
UNSUPPORTED = ("tools", "functions", "response_format", "logit_bias", "audio", "prediction")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: list[dict[str, str]]  # role + text content, ready for the chat template
    max_tokens: int | None
    temperature: float
    top_p: float
    stream: bool
    include_usage: bool
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    # vLLM's extensions, sent by its clients as extra body fields
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, f"'{key}' must be a number", param=key)
    if not lo <= value <= hi:
        raise ApiError(400, f"'{key}' must be between {lo} and {hi}, got {value}", param=key)
    return float(value)


def _optional_int(body: dict[str, Any], key: str, lo: int, hi: int = 2**63 - 1) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{key}' must be an integer", param=key)
    if not lo <= value <= hi:
        raise ApiError(400, f"'{key}' must be between {lo} and {hi}, got {value}", param=key)
    return value


def _message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ApiError(400, f"{where}: only text content parts are supported", param=where)
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise ApiError(400, f"{where} must be a string or a list of content parts", param=where)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ApiError(400, "'messages' is required and must be an array", param="messages")
    if not messages:
        raise ApiError(400, "'messages' must not be empty", param="messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ApiError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = msg.get("role")
        if role not in ROLES:
            raise ApiError(
                400, f"messages[{i}].role must be one of {sorted(ROLES)}", param=f"messages[{i}].role"
            )
        out.append({"role": role, "content": _message_text(msg.get("content"), f"messages[{i}].content")})
    return out


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP_STRINGS:
        return list(stop)
    raise ApiError(400, f"'stop' must be a string or up to {MAX_STOP_STRINGS} strings", param="stop")


def _token_ids(body: dict[str, Any], key: str) -> tuple[int, ...]:
    ids = body.get(key)
    if ids is None:
        return ()
    valid = isinstance(ids, list) and all(type(i) is int and 0 <= i < 2**32 for i in ids)
    if not valid:
        raise ApiError(400, f"'{key}' must be a list of token ids", param=key)
    return tuple(ids)


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required and must be a string", param="model")
    for key in UNSUPPORTED:
        if body.get(key) is not None:
            raise ApiError(400, f"'{key}' is not supported yet", param=key, code="unsupported_parameter")
    if _optional_int(body, "n", 1) not in (None, 1):
        raise ApiError(400, "only n=1 is supported yet", param="n", code="unsupported_parameter")
    if body.get("logprobs") not in (None, False):
        raise ApiError(400, "'logprobs' is not supported yet", param="logprobs", code="unsupported_parameter")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(
            400, "'stream_options' must be an object with a boolean include_usage", param="stream_options"
        )
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "'ignore_eos' must be a boolean", param="ignore_eos")
    max_tokens = _optional_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", 1)
    return ChatRequest(
        model=model,
        messages=_messages(body),
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        stop=_stop(body),
        seed=_optional_int(body, "seed", -(2**63)),
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        ignore_eos=ignore_eos,
    )


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


@dataclass(frozen=True, slots=True)
class ChunkWriter:
    """Chat completion chunks of one stream: same id and created on every chunk."""

    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage_,
        }

    def completion(self, text: str, finish_reason: str, usage_: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            ],
            "usage": usage_,
        }
