"""The one conversation form every API request is converted into, and every chat format renders. Pure.

Chat Completions, Responses and Messages requests all become a ``Conversation``; a chat format
(DeepSeek V4 / V4.1, or a model's own Jinja template) renders it to prompt text and tokens. The
fields mirror what the formats need, nothing API-specific: an API's own extras (``store``,
``metadata``, ...) stay in its request model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# "developer": a system-level instruction the API names apart (Responses); each format decides where
# it goes (DeepSeek V4.1 and templates: a system turn; V4, which hoists system turns: a user turn).
Role = Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]
ToolChoice = Literal["auto", "none", "required"]
Effort = Literal["low", "high", "xhigh", "max"]
ResponseFormat = Literal["text", "json_object", "json_schema", "regex"]


class RecipeError(ValueError):
    """A request the recipe cannot convert or render: the gateway answers 400 in the API's shape.

    ``param`` names the offending field in the client's request (``messages[2].content``) when known.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call in an assistant turn; ``arguments`` is JSON text (an object, by convention)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolDefinition:
    name: str
    description: str | None = None
    parameters: Any = None  # the JSON Schema of the arguments; None: no parameters declared
    strict: bool | None = None


@dataclass(frozen=True, slots=True)
class Message:
    """One turn. Only an assistant turn has reasoning, tool calls or ``prefix`` (continue it);
    only a tool turn has ``tool_call_id``."""

    role: Role
    content: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class Conversation:
    messages: tuple[Message, ...]
    # None: the model's default (on for DeepSeek V4/V4.1; template models decide themselves).
    thinking: bool | None = None
    tools: tuple[ToolDefinition, ...] = ()
    tool_choice: ToolChoice = "auto"
    effort: Effort | None = None
    response_format: ResponseFormat = "text"
    response_schema: Any = None  # json_schema: the schema (as the client sent it)
    response_regex: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # template variables (chat_template_kwargs)
