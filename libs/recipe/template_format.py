"""A Conversation -> prompt tokens through the model's own Jinja chat template. Pure.

Templates that know tools (they read ``tools`` / ``tool_calls``) get them the way transformers
passes them. Templates that do not (SmolLM2's ChatML) get our tool-call convention, the widely
trained "hermes" one: the tools are listed in the system turn, a call is written as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` and a result comes back in a user turn
as ``<tool_response>...</tool_response>``; the output parser reads the same syntax.

User-supplied text never becomes a special token: when some message spells one (``<|im_end|>``),
the template is rendered with placeholders for the messages' text, and that text is encoded
with the added vocabulary disabled (``Tokenizer.encode_plain``). A conversation with images is
rendered the same way, and each ``IMAGE_MARK`` in a message's text becomes one ``IMAGE_SLOT`` id
(the gateway expands it into the model's image tokens); ``Prompt.images`` lists the images in the
order of their slots.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from libs.protocol.messages import ImageSpan, StructuredOutput
from libs.recipe.chat_template import ChatTemplate
from libs.recipe.conversation import (
    IMAGE_MARK,
    IMAGE_SLOT,
    Conversation,
    ImageInput,
    Message,
    RecipeError,
    ToolCall,
    ToolDefinition,
)
from libs.recipe.dsml import Dialect
from libs.recipe.output_parser import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Stage, Syntax
from libs.recipe.tokenizer import Tokenizer

_PLACEHOLDER = "\x00{}\x00"  # no template invents NULs; each marks one message's text


@dataclass(frozen=True, slots=True)
class Prompt:
    """What a chat format makes of a conversation: the tokens, and how to read the output."""

    token_ids: list[int]
    syntax: Syntax  # the output parser's syntax
    start: Stage  # the stage the prompt leaves the model in
    parse_tool_calls: bool
    thinking: bool  # reasoning is expected in the output
    structured_output: StructuredOutput | None = None  # the output constraint (set by the gateway)
    dsml: Dialect | None = None  # a DeepSeek format's DSML spelling (syntax "deepseek")
    images: tuple[ImageInput, ...] = ()  # one per IMAGE_SLOT id in token_ids, in that order
    # Once the gateway expanded the slots (services/gateway/image_admission.py): where each image's
    # placeholder tokens sit, by content hash (``images`` is then empty)
    image_spans: tuple[ImageSpan, ...] = ()


def _tools_section(tools: Sequence[ToolDefinition]) -> str:
    lines = [
        json.dumps(
            {"name": t.name, "description": t.description or "", "parameters": t.parameters or {}},
            ensure_ascii=False,
        )
        for t in tools
    ]
    return (
        "# Tools\n\nYou may call functions to help with the request. "
        "Their signatures, one JSON object per line:\n<tools>\n"
        + "\n".join(lines)
        + "\n</tools>\n\nTo call a function, write a JSON object with its name and arguments "
        "between <tool_call></tool_call> tags, one block per call:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'
    )


def _format_section(conv: Conversation) -> str:
    if conv.response_format == "json_object":
        return "Reply with a single JSON object."
    if conv.response_format == "json_schema":
        schema = json.dumps(conv.response_schema, ensure_ascii=False)
        return f"Reply with a single JSON value that follows this JSON schema:\n{schema}"
    if conv.response_format == "regex":
        return f"Reply with text that matches this regular expression: {conv.response_regex}"
    return ""


def _arguments(call: ToolCall) -> Any:
    """A history call's arguments as JSON, or the client's text as a string when it is not JSON."""
    try:
        return json.loads(call.arguments) if call.arguments.strip() else {}
    except json.JSONDecodeError:
        return call.arguments


def _call_text(call: ToolCall) -> str:
    body = json.dumps({"name": call.name, "arguments": _arguments(call)}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


class TemplateFormat:
    """``tool_mode``: "native" when the template renders tools itself, else our convention."""

    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer) -> None:
        self.template = template
        self.tokenizer = tokenizer
        source = tokenizer.chat_template or ""
        self.tool_mode: Literal["native", "convention"] = (
            "native" if "tool_calls" in source and "tools" in source else "convention"
        )
        spellings = {tokenizer.id_to_token(i) for i in tokenizer.special_token_ids} - {""}
        # One pass over each message finds any special-token spelling (compiled once, not per request).
        alternatives = "|".join(map(re.escape, sorted(spellings, key=len, reverse=True)))
        self._special = re.compile(alternatives or "(?!)")  # (?!) never matches: no special tokens

    def prompt(self, conv: Conversation) -> Prompt:
        tools = () if conv.tool_choice == "none" else conv.tools
        forced = conv.tool_choice == "required" and bool(tools)
        turns = self._turns(conv, tools)
        messages = [self._message(m, tools) for m in turns]
        prefix = bool(conv.messages) and conv.messages[-1].prefix
        extra: dict[str, Any] = dict(conv.extra)
        if self.tool_mode == "native" and tools:
            extra["tools"] = [_tool_json(t) for t in tools]
        if conv.thinking is not None:
            extra.setdefault("enable_thinking", conv.thinking)
        token_ids, images = self._encode(messages, [m.images for m in turns], prefix, forced, extra)
        return Prompt(
            token_ids,
            syntax="hermes" if tools or conv.thinking else "plain",
            start="tool_calls" if forced else "content",
            parse_tool_calls=bool(tools),
            thinking=bool(conv.thinking),
            images=images,
        )

    def _turns(self, conv: Conversation, tools: Sequence[ToolDefinition]) -> list[Message]:
        """The conversation in roles every template knows; tool results merged per our convention."""
        preamble = "\n\n".join(
            s
            for s in (
                _tools_section(tools) if tools and self.tool_mode == "convention" else "",
                _format_section(conv),
            )
            if s
        )
        turns: list[Message] = []
        for msg in conv.messages:
            if msg.role == "tool" and self.tool_mode == "convention":
                result = f"<tool_response>\n{msg.content}\n</tool_response>"
                if turns and turns[-1].role == "user" and turns[-1].content.startswith("<tool_response>"):
                    turns[-1] = replace(turns[-1], content=turns[-1].content + "\n" + result)
                else:
                    turns.append(Message("user", result))
            elif msg.role == "latest_reminder":
                turns.append(replace(msg, role="user"))
            elif msg.role == "developer":
                turns.append(replace(msg, role="system"))  # templates know system, rarely developer
            else:
                turns.append(msg)
        if preamble:
            if turns and turns[0].role == "system":
                turns[0] = Message("system", f"{turns[0].content}\n\n{preamble}")
            else:
                turns.insert(0, Message("system", preamble))
        return turns

    def _message(self, msg: Message, tools: Sequence[ToolDefinition]) -> dict[str, Any]:
        out: dict[str, Any] = {"role": msg.role, "content": msg.content}
        if msg.role == "assistant" and msg.tool_calls:
            if self.tool_mode == "native":
                out["tool_calls"] = [_call_json(c) for c in msg.tool_calls]
            else:
                calls = "\n".join(_call_text(c) for c in msg.tool_calls)
                out["content"] = f"{msg.content}\n{calls}" if msg.content else calls
        if msg.role == "tool":
            out["tool_call_id"] = msg.tool_call_id
        if msg.reasoning is not None and self.tool_mode == "native":
            out["reasoning_content"] = msg.reasoning
        return out

    def _render(self, messages: list[dict[str, Any]], prefix: bool, extra: dict[str, Any]) -> str:
        try:
            if not prefix:
                return self.template.render(messages, add_generation_prompt=True, **extra)
            # Continue the last assistant turn: render it with a marker and cut there.
            marker = "\x00prefix\x00"
            last = {**messages[-1], "content": messages[-1]["content"] + marker}
            text = self.template.render([*messages[:-1], last], add_generation_prompt=False, **extra)
        except ValueError as exc:
            raise RecipeError(f"cannot render the chat template: {exc}", param="messages") from exc
        if marker not in text:
            raise RecipeError("this model's chat template cannot continue an assistant prefix")
        return text[: text.index(marker)]

    def _encode(
        self,
        messages: list[dict[str, Any]],
        images: list[tuple[ImageInput, ...]],
        prefix: bool,
        forced: bool,
        extra: dict[str, Any],
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The token ids, and the images in the order of their slots; ``images``: each message's."""
        suffix = TOOL_CALL_OPEN + "\n" if forced else ""
        texts = [m["content"] for m in messages]
        if not any(images) and not any(self._special.search(t) for t in texts):
            return self.tokenizer.encode(self._render(messages, prefix, extra) + suffix), ()
        # Some message spells a special token, or holds images: keep each message's text apart.
        held = [{**m, "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)]
        rendered = self._render(held, prefix, extra) + suffix
        ids: list[int] = []
        slotted: list[ImageInput] = []
        for i, part in enumerate(rendered.split("\x00")):
            if i % 2 == 0:  # the template's own text: its special tokens are real
                ids += self.tokenizer.encode(part, add_bos=i == 0)
                continue
            if not (part.isdecimal() and int(part) < len(texts)):  # the template transformed the text
                raise RecipeError("a message spells a special token this chat template cannot keep apart")
            ids += self._text_ids(texts[int(part)], images[int(part)])
            slotted += images[int(part)]
        if len(slotted) != sum(map(len, images)):  # a message dropped, or written twice
            raise RecipeError("this model's chat template does not keep each image of the conversation once")
        return ids, tuple(slotted)

    def _text_ids(self, text: str, images: tuple[ImageInput, ...]) -> list[int]:
        """A message's text as plain text, one IMAGE_SLOT where each of its ``images`` sits."""
        if not images:
            return self.tokenizer.encode_plain(text)
        pieces = text.split(IMAGE_MARK)
        if len(pieces) != len(images) + 1:
            raise RecipeError(
                "a message's text does not hold one image mark per image", param=images[0].param
            )
        ids = self.tokenizer.encode_plain(pieces[0])
        for piece in pieces[1:]:
            ids += [IMAGE_SLOT, *self.tokenizer.encode_plain(piece)]
        return ids


def _tool_json(tool: ToolDefinition) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.parameters or {"type": "object"}}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _call_json(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": _arguments(call)}
    return {"id": call.id, "type": "function", "function": function}
