"""Anthropic Messages ``system`` and ``messages`` -> Conversation messages. Pure.

A user turn's ``tool_result`` blocks (which must come first, as Anthropic requires) become tool
messages, its text blocks one following user message; an assistant turn's ``thinking`` blocks
become its reasoning (signatures are not checked), ``tool_use`` blocks its tool calls. The final
assistant turn is a prefill: ``prefix`` is set and the model continues it. A user turn's ``image``
blocks (base64 data, decoded here, or an http(s) URL) sit among its text blocks, each an
``IMAGE_MARK`` in the text; anywhere else (system, tool results, assistant turns) they are a 400.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from libs.recipe.api.common import (
    UNSUPPORTED_INPUT,
    ToolTurnWording,
    check_tool_turns,
    join_text,
    strict_base64,
    web_url,
)
from libs.recipe.conversation import IMAGE_MARK, IMAGE_MEDIA_TYPES, ImageInput, Message, ToolCall
from libs.recipe.fields import ApiError, check_depth, lookup, optional_bool, shown

_MEDIA = {"document": "document", "search_result": "search result"}

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


def _checked(text: str, where: str) -> str:
    """Client text as sent, refused when it holds the image mark: no client forges an image slot."""
    if IMAGE_MARK in text:
        raise ApiError(
            400, f"{where}: Input should not contain the reserved text {IMAGE_MARK!r}", param=where
        )
    return text


def _text(block: dict[str, Any], where: str) -> str:
    return _checked(_string(block, "text", where), f"{where}.text")


def _misplaced_image(where: str) -> ApiError:
    return ApiError(
        400, f"{where}: image blocks are only allowed in the content of user messages", param=where
    )


def _texts(content: Any, where: str) -> str:
    """A string, or text blocks joined (system prompts and tool_result contents)."""
    if isinstance(content, str):
        return _checked(content, where)
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: Input should be a valid string or list of blocks", param=where)
    texts = []
    for j, block in enumerate(content):
        kind = _block_type(block, f"{where}[{j}]")
        if kind == "image":
            raise _misplaced_image(f"{where}[{j}]")
        if kind != "text":
            raise ApiError(
                400, f"{where}[{j}]: only text blocks are supported here", param=f"{where}[{j}].type"
            )
        texts.append(_text(block, f"{where}[{j}]"))
    return join_text(texts)


def _base64_image(source: dict[str, Any], where: str, at: str) -> ImageInput:
    media_type = source.get("media_type")
    if not isinstance(media_type, str) or media_type not in IMAGE_MEDIA_TYPES:
        *head, last = [f"'{t}'" for t in IMAGE_MEDIA_TYPES]
        types = f"{', '.join(head)} or {last}"
        raise ApiError(400, f"{where}.media_type: Input should be {types}", param=f"{where}.media_type")
    data = strict_base64(_string(source, "data", where))
    if not data:
        raise ApiError(
            400, f"{where}.data: Input should be non-empty, valid base64 data", param=f"{where}.data"
        )
    return ImageInput(at, data=data, media_type=media_type)


def _image(block: dict[str, Any], at: str) -> ImageInput:
    """An image block: ``source`` is base64 data with its media type, or an http(s) URL."""
    source = block.get("source")
    where = f"{at}.source"
    if not isinstance(source, dict):
        raise ApiError(400, f"{where}: Input should be a valid dictionary", param=where)
    kind = source.get("type")
    if kind == "base64":
        return _base64_image(source, where, at)
    if kind != "url":
        raise ApiError(400, f"{where}.type: Input should be 'base64' or 'url'", param=f"{where}.type")
    url = _string(source, "url", where)
    if not web_url(url):
        raise ApiError(400, f"{where}.url: Input should be an http or https URL", param=f"{where}.url")
    return ImageInput(at, url=url)


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
    texts: list[str] = []  # text blocks, and an IMAGE_MARK for each image
    images: list[ImageInput] = []
    for at, kind, block in _blocks(content, where):
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "image":
            texts.append(IMAGE_MARK)
            images.append(_image(block, at))
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
    return results + ([Message("user", join_text(texts), images=tuple(images))] if texts else [])


def _assistant(content: list[Any], where: str, last: bool) -> Message:
    reasoning: list[str] | None = None
    texts: list[str] = []
    calls: list[ToolCall] = []
    for at, kind, block in _blocks(content, where):
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "image":
            raise _misplaced_image(at)
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
