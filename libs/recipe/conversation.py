"""The one conversation form every API request is converted into, and every chat format renders. Pure.

Chat Completions, Responses and Messages requests all become a ``Conversation``; a chat format
(DeepSeek V4 / V4.1, or a model's own Jinja template) renders it to prompt text and tokens. The
fields mirror what the formats need, nothing API-specific: an API's own extras (``store``,
``metadata``, ...) stay in its request model. A user turn's images stay undecoded ``ImageInput``s;
its text holds an ``IMAGE_MARK`` where each sits, which a format renders as one ``IMAGE_SLOT`` id.
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

IMAGE_MARK = "\x00image\x00"  # where an image sits in a message's text; client text never holds it
IMAGE_SLOT = -1  # the token id a chat format writes where an image goes (the gateway expands it)
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


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
class ImageInput:
    """One image of a message as the client sent it: bytes (base64 / data URL) or a URL. Not yet decoded."""

    param: str  # where it sits in the request, for 400s: "messages[1].content[0]"
    data: bytes = b""  # the file's bytes, base64-decoded
    media_type: str = ""  # as declared ("image/png"...); "" for a URL until fetched
    url: str = ""  # an http(s) URL; the gateway fetches it only from allowed hosts
    detail: str = "auto"  # OpenAI's "auto" | "low" | "high"


@dataclass(frozen=True, slots=True)
class Message:
    """One turn. Only an assistant turn has reasoning, tool calls or ``prefix`` (continue it);
    only a tool turn has ``tool_call_id``; only a user turn has ``images``, one ``IMAGE_MARK``
    in ``content`` for each, in order."""

    role: Role
    content: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    prefix: bool = False
    images: tuple[ImageInput, ...] = ()


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
