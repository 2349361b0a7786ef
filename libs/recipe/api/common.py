"""Request pieces every API shares: body and field checks, thinking/effort, output formats, and
the Conversation they all end in. Pure."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, NoReturn
from urllib.parse import urlsplit

from libs.recipe.api.tools import check_name
from libs.recipe.conversation import (
    Conversation,
    Effort,
    Message,
    ResponseFormat,
    ToolChoice,
    ToolDefinition,
)
from libs.recipe.fields import ApiError, check_depth, optional_bool, optional_dict, optional_str, shown

# Client effort names -> the formats' levels (the wheel's table; "none" means thinking off).
EFFORTS: dict[str, Effort | None] = {
    "none": None,
    "minimal": "low",
    "low": "low",
    "medium": "high",
    "high": "high",
    "xhigh": "xhigh",
    "max": "max",
}
UNSUPPORTED_INPUT = "{kind} input is not supported by this model"
MAX_PROMPT_CACHE_KEY_CHARS = 256


def json_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def check_fields(
    body: dict[str, Any], allowed: Iterable[str], message: Callable[[str], str], prefix: str = ""
) -> None:
    """Reject the first field outside ``allowed``: an ignored typo is worse than a 400."""
    known = frozenset(allowed)
    for key in body:
        if key not in known:
            raise ApiError(400, message(f"{prefix}{key}"), param=f"{prefix}{key}")


def reject_present(body: dict[str, Any], reasons: Mapping[str, str], prefix: str = "") -> None:
    """Fields we know but do not implement, each with why: refusing beats silently ignoring them.
    An explicit null is the field left out, as everywhere else."""
    for key, why in reasons.items():
        if body.get(key) is not None:
            refuse(f"{prefix}{key}", why)


def refuse(param: str, why: str) -> NoReturn:
    """The 400 for a known field (or value) this server does not serve, saying why."""
    raise ApiError(400, f"'{param}' is not supported: {why}", param=param, code="unsupported_parameter")


def one_of(obj: dict[str, Any], key: str, allowed: tuple[str, ...], param: str | None = None) -> str | None:
    """``obj[key]``, one of ``allowed`` (None when absent); ``param`` names it in the 400."""
    value = obj.get(key)
    if value is None or (isinstance(value, str) and value in allowed):
        return value
    where = param or key
    choices = ", ".join(map(repr, allowed))
    raise ApiError(400, f"'{where}' must be one of {choices}, got {shown(value)}", param=where)


def model_name(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required and must be a string", param="model")
    return model


def include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool | None):
        raise ApiError(
            400, "'stream_options' must be an object with a boolean include_usage", param="stream_options"
        )
    return bool(options.get("include_usage"))


def metadata(body: dict[str, Any]) -> dict[str, str]:
    """OpenAI's metadata: up to 16 string pairs (keys up to 64 chars, values up to 512)."""
    value = optional_dict(body, "metadata") or {}
    ok = len(value) <= 16 and all(
        isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()
    )
    if not ok:
        raise ApiError(400, "'metadata' must be at most 16 string key-value pairs", param="metadata")
    return dict(value)


def prompt_cache_retention(body: dict[str, Any]) -> str | None:
    """OpenAI's prompt-cache fields: ``prompt_cache_retention`` as sent (the gateway maps it to a
    retention class), and ``prompt_cache_key``, only validated: blocks are shared by content
    within a tenant already, so a routing hint adds nothing here."""
    key = optional_str(body, "prompt_cache_key")
    if key is not None and len(key) > MAX_PROMPT_CACHE_KEY_CHARS:
        message = f"'prompt_cache_key' must be at most {MAX_PROMPT_CACHE_KEY_CHARS} characters"
        raise ApiError(400, message, param="prompt_cache_key")
    return optional_str(body, "prompt_cache_retention")


def effort(value: Any, param: str) -> tuple[bool, Effort | None]:
    """(thinking wanted, effort) for a client's effort name; "none" asks for no thinking."""
    if not isinstance(value, str) or value not in EFFORTS:
        raise ApiError(
            400, f"'{param}' must be one of {', '.join(map(repr, EFFORTS))}, got {shown(value)}", param=param
        )
    return value != "none", EFFORTS[value]


def thinking_type(value: Any, param: str) -> bool | None:
    """A ``thinking: {type}`` object: enabled/adaptive -> on, disabled -> off, absent -> None."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise ApiError(
            400, f"'{param}.type' must be one of 'enabled', 'disabled', 'adaptive'", param=f"{param}.type"
        )
    return bool(kind != "disabled")


def resolve_thinking(
    explicit: bool | None, effort_value: Any, param: str, effort_implies_thinking: bool = True
) -> tuple[bool | None, Effort | None]:
    """(Conversation.thinking, Conversation.effort).

    An explicit thinking switch wins. Otherwise an effort turns thinking on (OpenAI's reading:
    asking for reasoning effort asks for reasoning) and "none" turns it off; with neither, None
    leaves it to the model's default. Effort is dropped when thinking is off.
    """
    wanted, level = (True, None) if effort_value is None else effort(effort_value, param)
    thinking = explicit
    if thinking is None and effort_value is not None and effort_implies_thinking:
        thinking = wanted
    if thinking is False or not wanted:
        return thinking, None
    return thinking, level


@dataclass(frozen=True, slots=True)
class OutputFormat:
    kind: ResponseFormat = "text"
    name: str | None = None
    description: str | None = None
    schema: Any = None  # json_schema: as the client sent it (strict normalisation is the constraint's)
    strict: bool | None = None
    regex: str | None = None


def _json_schema_format(spec: dict[str, Any], param: str) -> OutputFormat:
    """A json_schema format's body: Chat's nested ``json_schema`` object or Responses' flat one."""
    name = spec.get("name")
    if name is not None:
        check_name(name, f"{param}.name")
    description = optional_str(spec, "description", f"{param}.description")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ApiError(
            400, f"'{param}.schema' is required and must be a JSON Schema object", param=f"{param}.schema"
        )
    check_depth(schema, f"{param}.schema")
    strict = optional_bool(spec, "strict", f"{param}.strict")
    return OutputFormat("json_schema", name=name, description=description, schema=schema, strict=strict)


def _regex_format(spec: dict[str, Any], param: str) -> OutputFormat:
    regex = spec.get("regex")
    if not isinstance(regex, str) or not regex:
        raise ApiError(400, f"'{param}.regex' must be a non-empty string", param=f"{param}.regex")
    return OutputFormat("regex", regex=regex)


def output_format(spec: Any, param: str, nested: bool = False) -> OutputFormat:
    """Chat's ``response_format`` or Responses' ``text.format`` (``param``): text, json_object,
    json_schema or regex. A json_schema's body is ``spec`` itself (Responses), or with ``nested``
    the object under its ``json_schema`` key (Chat)."""
    if spec is None:
        return OutputFormat()
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind in ("text", "json_object"):
        return OutputFormat(kind)
    if kind == "json_schema" and not nested:
        return _json_schema_format(spec, param)
    if kind == "json_schema":
        inner = spec.get("json_schema")
        if not isinstance(inner, dict):
            raise ApiError(400, f"'{param}.json_schema' must be an object", param=f"{param}.json_schema")
        return _json_schema_format(inner, f"{param}.json_schema")
    if kind == "regex":
        return _regex_format(spec, param)
    raise ApiError(
        400,
        f"'{param}.type' must be one of 'text', 'json_object', 'json_schema', 'regex'",
        param=f"{param}.type",
    )


def require_json_word(messages: Iterable[Message], output: OutputFormat, message: str, param: str) -> None:
    """OpenAI's json_object guard: the word must appear somewhere in the prompt, any case.
    ``message`` and ``param`` are the endpoint's own wording of the 400."""
    if output.kind == "json_object" and not any("json" in m.content.lower() for m in messages):
        raise ApiError(400, message, param=param)


def without_reasoning(messages: tuple[Message, ...], thinking: bool | None) -> tuple[Message, ...]:
    """With thinking explicitly off, earlier turns' reasoning is dropped, as the wheel converts them."""
    if thinking is not False:
        return messages
    return tuple(replace(m, reasoning=None) if m.reasoning is not None else m for m in messages)


def build_conversation(
    messages: tuple[Message, ...],
    *,
    thinking: bool | None,
    effort: Effort | None,
    tool_choice: ToolChoice,
    tools: tuple[ToolDefinition, ...],
    output: OutputFormat,
    extra: dict[str, Any] | None = None,
) -> Conversation:
    """The validated pieces as one Conversation: reasoning dropped when thinking is off (as the
    wheel does) and the output format spelled out as the Conversation's response_* fields."""
    return Conversation(
        messages=without_reasoning(messages, thinking),
        thinking=thinking,
        tools=tools,
        tool_choice=tool_choice,
        effort=effort,
        response_format=output.kind,
        response_schema=output.schema,
        response_regex=output.regex,
        extra={} if extra is None else extra,
    )


def join_text(parts: list[str]) -> str:
    return "\n\n".join(parts)  # the wheel's separator for text parts and blocks


@dataclass(frozen=True, slots=True)
class ToolTurnWording:
    """How an API words its tool-history errors (each mirrors its vendor's message)."""

    unanswered: Callable[[list[str]], str]
    orphan: Callable[[str], str]  # a result with no open tool-call turn
    duplicate: Callable[[str], str]
    # A result whose id the open turn did not call: worded as ``orphan`` unless the API tells them apart.
    unknown_id: Callable[[str], str] | None = None


def check_tool_turns(
    messages: tuple[Message, ...], where: Callable[[int], str | None], wording: ToolTurnWording
) -> None:
    """Every tool result answers a call of the open assistant turn, and every call is answered
    before the next user or assistant turn (or the end). System and reminder turns may sit
    between results; their ordering, and the results' order, is the format's business."""
    pending: dict[str, int] = {}
    opened: int | None = None
    for i, message in enumerate(messages):
        if message.role in ("user", "assistant") and pending:
            raise ApiError(400, wording.unanswered(list(pending)), param=where(opened or 0))
        if message.role == "assistant" and message.tool_calls:
            ids = [call.id for call in message.tool_calls]
            for call_id in ids:
                if ids.count(call_id) > 1:
                    raise ApiError(400, wording.duplicate(call_id), param=where(i))
            pending, opened = dict.fromkeys(ids, i), i
        elif message.role == "tool":
            call_id = message.tool_call_id or ""
            if opened is None:
                raise ApiError(400, wording.orphan(call_id), param=where(i))
            if call_id not in pending:
                unknown = wording.unknown_id or wording.orphan
                raise ApiError(400, unknown(call_id), param=where(i))
            del pending[call_id]
        elif message.role in ("user", "assistant"):
            opened = None
    if pending:
        raise ApiError(400, wording.unanswered(list(pending)), param=where(opened or 0))


def strict_base64(payload: str) -> bytes | None:
    """Strict base64 (no whitespace, no URL-safe alphabet, padded); None when it is not."""
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):  # ValueError: a non-ASCII character
        return None


def web_url(url: str) -> bool:
    """An http(s) URL with a host (whether it may be fetched is the gateway's allow-list)."""
    try:
        parts = urlsplit(url)
    except ValueError:  # a malformed host ("http://[x")
        return False
    return parts.scheme.lower() in ("http", "https") and bool(parts.netloc)
