"""Render a ``Conversation`` as a DeepSeek V4 / V4.1 prompt, byte-identical to deepseek-recipe 0.2.0. Pure.

``DeepSeekV4Format.render`` gives the prompt text plus the code-point ranges that are real special
tokens; ``encode`` turns that into token ids, encoding the text between the ranges WITHOUT the
tokenizer's added vocabulary, so caller text that spells ``<｜User｜>`` stays plain text.
``parser_start`` says in which stage an output parser starts, given how the prompt ends.

The two versions differ in more than spelling (all observed from the wheel, pinned by golden tests):
V4 hoists every system message into the preamble, merges tool results with the user text around them
and sorts the N messages after an N-call assistant by tool-call id; V4.1 keeps system messages in place
behind ``<｜System｜>``, and sorts results by call order within one run of user/tool messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Final, Literal, Protocol

from libs.recipe.conversation import Conversation, Message, Role
from libs.recipe.dsml import (
    THINK_END,
    THINK_START,
    V4_DIALECT,
    V41_DIALECT,
    Dialect,
    Piece,
    response_format_section,
    tool_calls_block,
    tool_calls_prefill,
    tools_section,
)
from libs.recipe.output_parser import Stage

Version = Literal["v4", "v4.1"]

BOS: Final = "<｜begin▁of▁sentence｜>"
EOS: Final = "<｜end▁of▁sentence｜>"
SYSTEM: Final = "<｜System｜>"  # V4.1 only; the V4 vocabulary has no such token
USER: Final = "<｜User｜>"
ASSISTANT: Final = "<｜Assistant｜>"
LATEST_REMINDER: Final = "<｜latest_reminder｜>"

DEFAULT_V41_EFFORT_LEVELS: Final[Mapping[str, int]] = MappingProxyType(
    {"low": 50, "high": 75, "xhigh": 75, "max": 100}
)
_V41_EFFORT_RANGE: Final = "(range 1-100, the higher the value, the more thorough the reasoning)"
_V4_EFFORT_HIGH: Final = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
    "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked."
    "\n\n"
)
_V4_EFFORT_MAX: Final = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """Prompt text and the ascending, disjoint, half-open code-point ranges that are special tokens."""

    text: str
    special_ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Layout:
    """One rendering of a conversation, with what the output parser must know about it."""

    prompt: RenderedPrompt
    stage: Stage  # where the prompt leaves the model
    thinking: bool
    tools_on: bool  # tools declared and not switched off: the output may call them


class PromptTokenizer(Protocol):
    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` with added/special tokens NOT matched (they stay plain text)."""
        ...

    def special_id(self, spelling: str) -> int:
        """The id of an added token by its spelling; RecipeError when the vocabulary lacks it."""
        ...


def encode_prompt(prompt: RenderedPrompt, tokenizer: PromptTokenizer) -> list[int]:
    """Token ids: each special range as its token, the text between with no added vocabulary (so
    text that spells a special token stays text)."""
    ids: list[int] = []
    position = 0
    for start, end in prompt.special_ranges:
        if start > position:
            ids += tokenizer.encode_plain(prompt.text[position:start])
        ids.append(tokenizer.special_id(prompt.text[start:end]))
        position = end
    if position < len(prompt.text):
        ids += tokenizer.encode_plain(prompt.text[position:])
    return ids


class _Builder:
    """Accumulates prompt text and the ranges of its special tokens."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._ranges: list[tuple[int, int]] = []
        self._length = 0
        self.last_stage_token: str | None = None  # the last <think>, </think> or <｜Assistant｜> written

    def text(self, text: str) -> None:
        self._parts.append(text)
        self._length += len(text)

    def special(self, spelling: str) -> None:
        self._ranges.append((self._length, self._length + len(spelling)))
        self.text(spelling)
        if spelling in (THINK_START, THINK_END, ASSISTANT):
            self.last_stage_token = spelling

    def pieces(self, pieces: Sequence[Piece]) -> None:
        for text, is_special in pieces:
            self.special(text) if is_special else self.text(text)

    def build(self) -> RenderedPrompt:
        return RenderedPrompt("".join(self._parts), tuple(self._ranges))


@dataclass(frozen=True, slots=True)
class _Context:
    thinking: bool
    tools_on: bool  # tools declared and not switched off by tool_choice "none"


def _part(message: Message) -> str:
    """A user or tool message's text inside a user turn."""
    return f"<tool_result>{message.content}</tool_result>" if message.role == "tool" else message.content


def _v4_window_key(message: Message) -> tuple[int, str]:
    # V4 orders results by tool-call id as a string (no id: ""), not by call order; other messages last.
    return (0, message.tool_call_id or "") if message.role == "tool" else (1, "")


def _v41_sorted_group(group: list[Message], call_order: Mapping[str, int]) -> list[Message]:
    """V4.1: results with an id move into call order (unknown ids rank 0) within the slots they hold."""
    slots = [
        k for k, message in enumerate(group) if message.role == "tool" and message.tool_call_id is not None
    ]
    ranked = sorted((group[k] for k in slots), key=lambda m: call_order.get(m.tool_call_id or "", 0))
    result = list(group)
    for slot, message in zip(slots, ranked, strict=True):
        result[slot] = message
    return result


class DeepSeekV4Format:
    """The DeepSeek V4 or V4.1 chat format."""

    def __init__(self, version: Version, effort_levels: Mapping[str, int] | None = None) -> None:
        if version not in ("v4", "v4.1"):
            raise ValueError(f"unknown DeepSeek format version {version!r}")
        self.version: Version = version
        self._dialect: Dialect = V4_DIALECT if version == "v4" else V41_DIALECT
        # V4.1 writes effort as a number; levels missing from a custom mapping keep the wheel's value.
        self.effort_levels: Mapping[str, int] = MappingProxyType(
            {**DEFAULT_V41_EFFORT_LEVELS, **(effort_levels or {})}
        )

    @property
    def dialect(self) -> Dialect:
        return self._dialect

    def render(self, conv: Conversation) -> RenderedPrompt:
        return self.layout(conv).prompt

    def parser_start(self, conv: Conversation) -> Stage:
        return self.layout(conv).stage

    def encode(self, conv: Conversation, tokenizer: PromptTokenizer) -> list[int]:
        return encode_prompt(self.render(conv), tokenizer)

    def layout(self, conv: Conversation) -> Layout:
        prompt, stage, ctx = self._render(conv)
        return Layout(prompt, stage, ctx.thinking, ctx.tools_on)

    # ---- rendering ------------------------------------------------------------------------------------

    # ---- rendering ------------------------------------------------------------------------------------

    def _render(self, conv: Conversation) -> tuple[RenderedPrompt, Stage, _Context]:
        # A developer message is a user turn in V4 (which hoists system turns) and a system turn in V4.1.
        developer: Role = "user" if self.version == "v4" else "system"
        messages = tuple(replace(m, role=developer) if m.role == "developer" else m for m in conv.messages)
        conv = replace(conv, messages=messages)
        ctx = _Context(
            thinking=conv.thinking is not False,  # None: DeepSeek's default, thinking on
            tools_on=bool(conv.tools) and conv.tool_choice != "none",
        )
        out = _Builder()
        out.special(BOS)
        if self.version == "v4":
            self._v4_preamble(conv, ctx, out)
            continuing = self._v4_body(conv, ctx, out)
        else:
            continuing = self._v41_body(conv, self._v41_preamble(conv, ctx, out), ctx, out)
        if not continuing:
            out.special(ASSISTANT)
            out.special(THINK_START if ctx.thinking else THINK_END)
        forced = ctx.tools_on and conv.tool_choice == "required"
        if forced:
            out.pieces(tool_calls_prefill(self._dialect))
        return out.build(), self._stage(forced, ctx, out), ctx

    @staticmethod
    def _stage(forced: bool, ctx: _Context, out: _Builder) -> Stage:
        if forced:
            return "tool_calls"
        if out.last_stage_token == THINK_START:
            return "reasoning"
        if out.last_stage_token == THINK_END:
            return "content"
        # A V4 prefix turn with neither reasoning nor content leaves only <｜Assistant｜> behind.
        return "reasoning" if ctx.thinking else "content"

    def _sections(self, conv: Conversation, ctx: _Context) -> tuple[list[Piece], str]:
        tools = tools_section(conv.tools, self._dialect) if ctx.tools_on else []
        return tools, response_format_section(conv.response_format, conv.response_schema, self._dialect)

    def _v4_preamble(self, conv: Conversation, ctx: _Context, out: _Builder) -> None:
        effort = ""
        if ctx.thinking and conv.effort != "low":
            effort = _V4_EFFORT_MAX if conv.effort == "max" else _V4_EFFORT_HIGH
        # V4 has no system token: every non-empty system message joins the preamble, in order.
        systems = "\n\n".join(m.content for m in conv.messages if m.role == "system" and m.content)
        tools, response_format = self._sections(conv, ctx)
        out.text(effort + systems)
        out.pieces(tools)
        out.text(response_format)

    def _v41_preamble(self, conv: Conversation, ctx: _Context, out: _Builder) -> int:
        """Writes the leading <｜System｜> block if there is one; returns how many messages it consumed."""
        first_is_system = bool(conv.messages) and conv.messages[0].role == "system"
        effort = ""
        if ctx.thinking:
            level = self.effort_levels[conv.effort or "high"]
            effort = f"Reasoning Effort: {level} {_V41_EFFORT_RANGE}\n\n"
        tools, response_format = self._sections(conv, ctx)
        # The effort line alone opens the block only in a non-empty conversation.
        if not (first_is_system or (effort and conv.messages) or tools or response_format):
            return 0
        out.special(SYSTEM)
        out.text(effort + (conv.messages[0].content if first_is_system else ""))
        out.pieces(tools)
        out.text(response_format)
        return 1 if first_is_system else 0

    def _v4_body(self, conv: Conversation, ctx: _Context, out: _Builder) -> bool:
        """Writes the turns; True when the last one is a prefix turn the model continues."""
        # (original index, message); consecutive user messages merge into one before the sort.
        items: list[tuple[int, Message]] = []
        for index, message in enumerate(conv.messages):
            if message.role == "system":
                continue
            if message.role == "user" and items and items[-1][1].role == "user":
                # This merge (unlike joining parts of a user turn below) skips empty texts.
                merged = "\n\n".join(text for text in (items[-1][1].content, message.content) if text)
                images = items[-1][1].images + message.images
                items[-1] = (index, Message(role="user", content=merged, images=images))
            else:
                items.append((index, message))
        # After an assistant with N calls, the N positions that follow it (only if there are N) are stably
        # sorted: tool results by id, then everything else. Positions are those of the unsorted list, and
        # the sorts apply in order, each to what earlier sorts left there (windows may overlap).
        windows = [(i + 1, len(m.tool_calls)) for i, (_, m) in enumerate(items) if m.role == "assistant"]
        for start, count in windows:
            if count and start + count <= len(items):
                window = items[start : start + count]
                items[start : start + count] = sorted(window, key=lambda item: _v4_window_key(item[1]))
        open_turn: str | None = None  # role of the last part of the user turn being written
        for index, message in items:
            if message.role in ("user", "tool"):
                # A tool result after user text starts a new user turn; anything else joins the open one.
                if open_turn is None or (message.role == "tool" and open_turn == "user"):
                    out.special(USER)
                    out.text(_part(message))
                else:
                    out.text("\n\n" + _part(message))
                open_turn = message.role
                continue
            open_turn = None
            if message.role == "latest_reminder":
                out.special(LATEST_REMINDER)
                out.text(message.content)
            else:
                self._assistant(message, index == 0, message is items[-1][1], ctx, out)
        return bool(items) and items[-1][1].role == "assistant" and items[-1][1].prefix

    def _v41_body(self, conv: Conversation, start: int, ctx: _Context, out: _Builder) -> bool:
        """Writes the turns; True when the last one is a prefix turn the model continues."""
        messages = conv.messages
        # The wheel counts a tools / response format preamble as a message before the first one.
        has_sections = ctx.tools_on or conv.response_format in ("json_object", "json_schema")
        call_order: dict[str, int] = {}  # of the latest assistant turn that made calls
        i = start
        while i < len(messages):
            message = messages[i]
            if message.role in ("user", "tool"):
                # One user turn per run of user/tool messages, results sorted into call order.
                end = i
                while end < len(messages) and messages[end].role in ("user", "tool"):
                    end += 1
                out.special(USER)
                out.text("\n\n".join(map(_part, _v41_sorted_group(list(messages[i:end]), call_order))))
                i = end
                continue
            if message.role == "system":
                out.special(SYSTEM)
                out.text(message.content)
            elif message.role == "latest_reminder":
                # Of reminders in a row only the first is kept.
                if i == 0 or messages[i - 1].role != "latest_reminder":
                    out.special(LATEST_REMINDER)
                    out.text(message.content)
            else:
                if message.tool_calls:
                    call_order = {}
                    for position, call in enumerate(message.tool_calls):
                        call_order.setdefault(call.id, position)
                self._assistant(message, i == 0 and not has_sections, i == len(messages) - 1, ctx, out)
            i += 1
        return bool(messages) and messages[-1].role == "assistant" and messages[-1].prefix

    def _assistant(
        self, message: Message, is_first: bool, is_last: bool, ctx: _Context, out: _Builder
    ) -> None:
        out.special(ASSISTANT)
        if self.version == "v4":
            # V4 keeps reasoning when tools are on or the turn is a prefix; missing, it is empty in thinking
            # mode (as the wheel's conversion fills it) and absent otherwise.
            reasoning = "" if message.reasoning is None and ctx.thinking else message.reasoning
            if (message.prefix or ctx.tools_on) and reasoning is not None:
                out.special(THINK_START)
                out.text(reasoning)
            if not message.prefix or message.content or not ctx.thinking:
                out.special(THINK_END)
        elif message.prefix and ctx.thinking and not is_first:
            # A thinking prefix stays inside <think> unless it already has an answer or calls (V4.1 treats a
            # prefix that opens the conversation like an ordinary turn here).
            out.special(THINK_START)
            out.text(message.reasoning or "")
            if message.content or message.tool_calls:
                out.special(THINK_END)
        else:
            # V4.1 keeps reasoning (missing: empty) iff thinking with tools on.
            if ctx.thinking and ctx.tools_on:
                out.special(THINK_START)
                out.text(message.reasoning or "")
            out.special(THINK_END)
        out.text(message.content)
        if message.tool_calls:
            calls = message.tool_calls
            if self.version == "v4":
                calls = tuple(sorted(calls, key=lambda call: call.id))  # V4 lists calls in id order
            out.text("\n\n")
            out.pieces(tool_calls_block(calls, self._dialect))
        # A continued turn stays open; V4 closes one that is not the conversation's last message.
        if not message.prefix or (self.version == "v4" and not is_last):
            out.special(EOS)
