"""Anthropic Messages ``system`` and ``messages`` -> Conversation messages. Pure.

A user turn's ``tool_result`` blocks (which must come first, as Anthropic requires) become tool
messages, its text blocks one following user message; an assistant turn's ``thinking`` blocks
become its reasoning (signatures are not checked), ``tool_use`` blocks its tool calls. The final
assistant turn is a prefill: ``prefix`` is set and the model continues it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from libs.recipe.api.common import UNSUPPORTED_INPUT, ToolTurnWording, check_tool_turns, join_text
from libs.recipe.conversation import Message, ToolCall
from libs.recipe.fields import ApiError, check_depth, lookup, optional_bool, shown

_MEDIA = {"image": "image", "document": "document", "search_result": "search result"}

WORDING = ToolTurnWording(
    unanswered=lambda ids: (
        f"`tool_use` ids were found without `tool_result` blocks immediately after: {', '.join(ids)}. "
        "Each `tool_use` block must have a corresponding `tool_result` block in the next message."
    ),
    orphan=lambda call_id: (
        f"unexpected `tool_use_id` found in `tool_result` blocks: {call_id}. Each `tool_result` block "
        "must have a corresponding `tool_use` block in the previous message."
    ),
    duplicate=lambda call_id: f"`tool_use` ids must be unique: {call_id}",
)


def _block_type(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise ApiError(400, f"{where}.type: Field required", param=f"{where}.type")
    medium = lookup(_MEDIA, kind)
    if medium is not None:
        raise ApiError(400, UNSUPPORTED_INPUT.format(kind=medium), param=where)
    return kind


def _string(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key}: Input should be a valid string", param=f"{where}.{key}")
    return value


def _texts(content: Any, where: str) -> str:
    """A string, or text blocks joined (system prompts and tool_result contents)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: Input should be a valid string or list of blocks", param=where)
    texts = []
    for j, block in enumerate(content):
        if _block_type(block, f"{where}[{j}]") != "text":
            raise ApiError(
                400, f"{where}[{j}]: only text blocks are supported here", param=f"{where}[{j}].type"
            )
        texts.append(_string(block, "text", f"{where}[{j}]"))
    return join_text(texts)


def system_text(system: Any) -> str | None:
    return None if system is None else _texts(system, "system")


def _blocks(content: list[Any], where: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(path, type, block) for each block of message ``where``'s content (untyped and media
    blocks are refused)."""
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        yield at, _block_type(block, at), block


def _user(content: list[Any], where: str) -> list[Message]:
    results: list[Message] = []
    texts: list[str] = []
    for at, kind, block in _blocks(content, where):
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "tool_result":
            if texts:
                raise ApiError(400, f"{at}: tool_result blocks must come before any other content", param=at)
            optional_bool(
                block, "is_error", f"{at}.is_error", f"{at}.is_error: Input should be a valid boolean"
            )
            body = block.get("content")
            output = "" if body is None else _texts(body, f"{at}.content")
            results.append(Message("tool", output, tool_call_id=_string(block, "tool_use_id", at)))
        else:
            raise ApiError(
                400,
                f"{at}: blocks of type {shown(kind)} are not supported in user messages",
                param=f"{at}.type",
            )
    return results + ([Message("user", join_text(texts))] if texts else [])


def _assistant(content: list[Any], where: str, last: bool) -> Message:
    reasoning: list[str] | None = None
    texts: list[str] = []
    calls: list[ToolCall] = []
    for at, kind, block in _blocks(content, where):
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "thinking":
            reasoning = [*(reasoning or []), _string(block, "thinking", at)]
        elif kind == "tool_use":
            arguments = block.get("input")
            if not isinstance(arguments, dict):
                raise ApiError(400, f"{at}.input: Input should be a valid dictionary", param=f"{at}.input")
            check_depth(arguments, f"{at}.input")  # json.dumps recurses
            # The wheel's spelling of the arguments (", " and ": " separators, UTF-8 kept).
            text = json.dumps(arguments, ensure_ascii=False)
            calls.append(ToolCall(_string(block, "id", at), _string(block, "name", at), text))
        else:  # redacted_thinking (encrypted: nothing to render), server_tool_use, ...
            raise ApiError(400, f"{at}: blocks of type {shown(kind)} are not supported", param=f"{at}.type")
    return Message(
        "assistant",
        join_text(texts),
        reasoning=None if reasoning is None else join_text(reasoning),
        tool_calls=tuple(calls),
        prefix=last and not calls,
    )


def parse_messages(raw: Any) -> tuple[Message, ...]:
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages: Field required (a non-empty list)", param="messages")
    out: list[Message] = []
    origins: list[int] = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ("user", "assistant"):
            raise ApiError(400, f"{where}.role: Input should be 'user' or 'assistant'", param=f"{where}.role")
        content = msg.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list) or not content or content == [{"type": "text", "text": ""}]:
            raise ApiError(
                400, f"{where}: all messages must have non-empty content", param=f"{where}.content"
            )
        converted = (
            _user(content, where) if role == "user" else [_assistant(content, where, i == len(raw) - 1)]
        )
        out.extend(converted)
        origins.extend([i] * len(converted))
    messages = tuple(out)
    check_tool_turns(messages, lambda k: f"messages[{origins[k]}]", WORDING)
    return messages
