"""OpenAI Responses ``input`` items -> Conversation messages. Pure.

Consecutive assistant-side items form one assistant turn, as the wheel groups them: a reasoning
item with ``reasoning_text`` parts opens a turn (they become its reasoning; summary-only items
are skipped), assistant messages
add text, function calls add tool calls; a user/system message, a function_call_output, a new
reasoning item after text or calls, or assistant text after a call closes the turn. A user
message's ``input_image`` parts are its images (a data URL or an http(s) URL; no ``file_id``: there
is no file store); files and audio are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from libs.recipe.api.common import ToolTurnWording, join_text, one_of, refuse
from libs.recipe.api.openai_content import (
    DETAILS,
    PartTypes,
    client_text,
    image_input,
    message_content,
    message_role,
)
from libs.recipe.conversation import ImageInput, Message, Role, ToolCall
from libs.recipe.fields import ApiError, shown

# A developer message stays one: where it goes is the format's choice (the wheel: V4 user, V4.1 system).
ROLES: dict[str, Role] = {
    "user": "user", "system": "system", "developer": "developer", "assistant": "assistant"
}  # fmt: skip


def _image(part: dict[str, Any], where: str) -> ImageInput:
    """``{"type": "input_image", "image_url": <data or http(s) URL>, "detail"}``."""
    if part.get("file_id") is not None:
        refuse(f"{where}.file_id", "there is no file store here: send the image as 'image_url'")
    url = part.get("image_url")
    if not isinstance(url, str):
        raise ApiError(
            400, f"'{where}.image_url' is required and must be a string", param=f"{where}.image_url"
        )
    return image_input(url, where, f"{where}.image_url", one_of(part, "detail", DETAILS, f"{where}.detail"))


PARTS = PartTypes(
    text=("input_text", "output_text"),
    image="input_image",
    read_image=_image,
    media={"input_file": "file", "input_audio": "audio"},
)

WORDING = ToolTurnWording(
    unanswered=lambda ids: f"No tool output found for function call {', '.join(ids)}.",
    orphan=lambda call_id: f"No tool call found for function call output with call_id {call_id}.",
    duplicate=lambda call_id: f"Duplicate 'call_id': {call_id}.",
)


@dataclass
class _Turn:
    origin: int  # the item that opened it, for error params
    reasoning: list[str] | None = None
    texts: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)

    def message(self) -> Message:
        reasoning = None if self.reasoning is None else "\n".join(self.reasoning)
        return Message("assistant", join_text(self.texts), reasoning=reasoning, tool_calls=tuple(self.calls))


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"'{where}.{key}' is required and must be a string", param=f"{where}.{key}")
    return value


def _content(content: Any, where: str, user: bool = False) -> tuple[str, tuple[ImageInput, ...]]:
    return message_content(content, where, PARTS, user)


def _reasoning_text(item: dict[str, Any], where: str) -> list[str]:
    # Only raw reasoning_text parts are the model's reasoning: summaries are a paraphrase of it.
    content = item.get("content") or []
    if not isinstance(content, list):
        raise ApiError(400, f"'{where}.content' must be an array", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") != "reasoning_text"
            or not isinstance(part.get("text"), str)
        ):
            raise ApiError(
                400, f"'{where}.content[{j}]' must be a reasoning_text part", param=f"{where}.content[{j}]"
            )
        texts.append(part["text"])
    return texts


class _Builder:
    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.origins: list[int] = []
        self.turn: _Turn | None = None

    def close(self) -> None:
        if self.turn is not None:
            self.emit(self.turn.message(), self.turn.origin)
            self.turn = None

    def emit(self, message: Message, origin: int) -> None:
        self.messages.append(message)
        self.origins.append(origin)

    def open(self, i: int, fresh: bool) -> _Turn:
        if self.turn is not None and fresh:
            self.close()
        if self.turn is None:
            self.turn = _Turn(i)
        return self.turn

    def message(self, item: dict[str, Any], i: int, where: str) -> None:
        role = message_role(item, ROLES, where)
        text, images = _content(item.get("content"), f"{where}.content", user=role == "user")
        if role == "assistant":
            turn = self.open(i, fresh=bool(self.turn and self.turn.calls))
            turn.texts.append(text)
        else:
            self.close()
            self.emit(Message(role, text, images=images), i)

    def reasoning(self, item: dict[str, Any], i: int, where: str) -> None:
        texts = _reasoning_text(item, where)
        if not texts:
            return  # summary or encrypted_content only: nothing to render, and no new turn (as the wheel)
        turn = self.open(i, fresh=bool(self.turn and (self.turn.texts or self.turn.calls)))
        turn.reasoning = (turn.reasoning or []) + texts

    def function_call(self, item: dict[str, Any], i: int, where: str) -> None:
        call = ToolCall(
            id=_string(item, "call_id", where),
            name=_string(item, "name", where),
            arguments=_string(item, "arguments", where),
        )
        self.open(i, fresh=False).calls.append(call)

    def function_call_output(self, item: dict[str, Any], i: int, where: str) -> None:
        call_id = _string(item, "call_id", where)
        output, _ = _content(item.get("output"), f"{where}.output")  # no images: not a user message
        self.close()
        self.emit(Message("tool", output, tool_call_id=call_id), i)


def parse_input(raw: Any) -> tuple[tuple[Message, ...], tuple[int, ...]]:
    """The input's messages, and for each the index of the item it came from."""
    if isinstance(raw, str):
        return (Message("user", client_text(raw, "input")),), (0,)
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'input' is required: a string or a non-empty array of items", param="input")
    builder = _Builder()
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"'{where}' must be an object", param=where)
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            raise ApiError(400, f"'{where}.type' must be a string", param=f"{where}.type")
        handler = {
            "message": builder.message,
            "reasoning": builder.reasoning,
            "function_call": builder.function_call,
            "function_call_output": builder.function_call_output,
        }.get(kind)
        if handler is None:
            raise ApiError(
                400,
                f"input items of type {shown(kind)} are not supported",
                param=f"{where}.type",
                code="unsupported_parameter",
            )
        handler(item, i, where)
    builder.close()
    return tuple(builder.messages), tuple(builder.origins)
