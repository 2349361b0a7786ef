"""Chat Completions ``messages`` -> Conversation messages, with OpenAI's tool-history rules. Pure.

Roles: system, developer (a system turn: OpenAI's newer name for it), user, assistant, tool, and
DeepSeek's latest_reminder. Content is a string or text parts joined with "\\n\\n"; a user turn's
``image_url`` parts are its images (each an ``IMAGE_MARK`` in the text), other media parts are
refused cleanly. Assistant turns carry DeepSeek's ``reasoning_content`` and ``prefix`` extensions.
"""

from __future__ import annotations

from typing import Any

from libs.recipe.api.common import ToolTurnWording, check_tool_turns, one_of
from libs.recipe.api.openai_content import DETAILS, PartTypes, image_input, message_content, message_role
from libs.recipe.conversation import ImageInput, Message, Role, ToolCall
from libs.recipe.fields import ApiError, optional_bool

ROLES: dict[str, Role] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "latest_reminder": "latest_reminder",
}


def _image(part: dict[str, Any], where: str) -> ImageInput:
    """``{"type": "image_url", "image_url": {"url", "detail"}}``; a bare URL string too, as vLLM takes."""
    spec = part.get("image_url")
    if isinstance(spec, str):
        return image_input(spec, where, f"{where}.image_url", None)
    if not isinstance(spec, dict):
        message = f"'{where}.image_url' must be an object with a 'url' (or a URL string)"
        raise ApiError(400, message, param=f"{where}.image_url")
    if not isinstance(spec.get("url"), str):
        raise ApiError(
            400, f"'{where}.image_url.url' is required and must be a string", param=f"{where}.image_url.url"
        )
    detail = one_of(spec, "detail", DETAILS, f"{where}.image_url.detail")
    return image_input(spec["url"], where, f"{where}.image_url.url", detail)


PARTS = PartTypes(
    text=("text",), image="image_url", read_image=_image, media={"input_audio": "audio", "file": "file"}
)

WORDING = ToolTurnWording(
    unanswered=lambda ids: (
        "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
        f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(ids)}"
    ),
    orphan=lambda _: (
        "Invalid parameter: messages with role 'tool' must be a response to a preceding message "
        "with 'tool_calls'."
    ),
    unknown_id=lambda call_id: (
        f"Invalid parameter: 'tool_call_id' of '{call_id}' not found in 'tool_calls' of previous message."
    ),
    duplicate=lambda call_id: f"Duplicate value for 'tool_call_id' of {call_id}.",
)


def _tool_call(raw: Any, where: str) -> ToolCall:
    function = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(function, dict):
        raise ApiError(
            400, f"'{where}.function' is required and must be an object", param=f"{where}.function"
        )
    if raw.get("type", "function") != "function":
        raise ApiError(400, f"'{where}.type' must be 'function'", param=f"{where}.type")
    checks = (
        (raw, "id", where),
        (function, "name", f"{where}.function"),
        (function, "arguments", f"{where}.function"),
    )
    for obj, key, path in checks:
        if not isinstance(obj.get(key), str):
            raise ApiError(400, f"'{path}.{key}' is required and must be a string", param=f"{path}.{key}")
    return ToolCall(id=raw["id"], name=function["name"], arguments=function["arguments"])


def _tool_calls(raw: Any, where: str) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ApiError(400, f"'{where}' must be an array", param=where)
    return tuple(_tool_call(call, f"{where}[{j}]") for j, call in enumerate(raw))


def _assistant(msg: dict[str, Any], where: str, content: str | None, last: bool) -> Message:
    calls = _tool_calls(msg.get("tool_calls"), f"{where}.tool_calls")
    reasoning = msg.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ApiError(
            400, f"'{where}.reasoning_content' must be a string", param=f"{where}.reasoning_content"
        )
    prefix = optional_bool(msg, "prefix", f"{where}.prefix")
    if prefix and not last:
        raise ApiError(400, "Only the last message may be an assistant 'prefix'", param=f"{where}.prefix")
    if prefix and calls:
        raise ApiError(400, "An assistant 'prefix' cannot have 'tool_calls'", param=f"{where}.prefix")
    if content is None and not calls and not isinstance(msg.get("refusal"), str):
        raise ApiError(
            400, f"'{where}.content' or '{where}.tool_calls' must be set", param=f"{where}.content"
        )
    return Message("assistant", content or "", reasoning=reasoning, tool_calls=calls, prefix=bool(prefix))


def _message(msg: Any, i: int, last: bool) -> Message:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise ApiError(400, f"'{where}' must be an object", param=where)
    role = message_role(msg, ROLES, where)
    raw = msg.get("content")
    # None stays None here: an assistant turn may carry only tool calls; the others refuse it below.
    content, images = (
        (None, ()) if raw is None else message_content(raw, f"{where}.content", PARTS, role == "user")
    )
    if role == "assistant":
        return _assistant(msg, where, content, last)
    if content is None:
        raise ApiError(
            400, f"'{where}.content' is required for role '{msg['role']}'", param=f"{where}.content"
        )
    if role != "tool":
        return Message(role, content, images=images)
    call_id = msg.get("tool_call_id")
    if not isinstance(call_id, str):
        raise ApiError(
            400, f"'{where}.tool_call_id' is required and must be a string", param=f"{where}.tool_call_id"
        )
    return Message("tool", content, tool_call_id=call_id)


def parse_messages(raw: Any) -> tuple[Message, ...]:
    if not isinstance(raw, list):
        raise ApiError(400, "'messages' is required and must be an array", param="messages")
    if not raw:
        raise ApiError(400, "'messages' must not be empty", param="messages")
    messages = tuple(_message(msg, i, i == len(raw) - 1) for i, msg in enumerate(raw))
    check_tool_turns(messages, lambda i: f"messages[{i}]", WORDING)
    return messages
