"""OpenAI Chat Completions: request validation. Pure: a JSON body in, a ChatRequest out.

Sampling fields are read by ``sampling``; response shapes live in ``responses``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.fields import ApiError, boolean
from services.gateway.sampling import Sampling, parse_sampling

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# Fields we accept but do not support yet: refusing beats silently ignoring them.
UNSUPPORTED = ("tools", "functions", "response_format", "logit_bias", "audio", "prediction")


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: list[dict[str, str]]  # role + text content, ready for the chat template
    sampling: Sampling
    stream: bool
    include_usage: bool


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


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool | None):
        raise ApiError(
            400, "'stream_options' must be an object with a boolean include_usage", param="stream_options"
        )
    return bool(options.get("include_usage"))


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required and must be a string", param="model")
    for key in UNSUPPORTED:
        if body.get(key) is not None:
            raise ApiError(400, f"'{key}' is not supported yet", param=key, code="unsupported_parameter")
    return ChatRequest(
        model=model,
        messages=_messages(body),
        sampling=parse_sampling(body),
        stream=boolean(body, "stream"),
        include_usage=_include_usage(body),
    )
