"""What the output parser hands the API encoders: typed pieces of one choice's generated text. Pure.

The parser turns decoded text into segments; each API's encoder turns segments into its own
events (Chat chunks, Responses events, Messages events). Concatenating a choice's segments of
one kind gives the final message: all ``Reasoning`` texts its reasoning, all ``Content`` texts
its content, and per tool call, its ``ToolCallArgs`` texts its arguments JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Reasoning:
    text: str


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """A tool call begins: its name is known whole; arguments follow as ``ToolCallArgs``."""

    index: int  # 0, 1, ... within the choice
    call_id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgs:
    index: int
    text: str  # the next fragment of the arguments' JSON text


Segment = Reasoning | Content | ToolCallStart | ToolCallArgs

# How a choice ended, before any API's spelling: "eos" (the model ended it or a stop token),
# "stop_sequence" (a stop string matched), "length" (max_tokens or the context window),
# "abort" (cancelled), "error".
EndReason = Literal["eos", "stop_sequence", "length", "abort", "error"]


@dataclass(frozen=True, slots=True)
class Finish:
    reason: EndReason
    stop_sequence: str | None = None  # the matched string, for "stop_sequence"
    error: str = ""


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of prompt_tokens, served from the prefix cache
    reasoning_tokens: int = 0  # of completion_tokens
    # Predicted Outputs: of the prediction's tokens offered as drafts, those that ended in the
    # output (accepted) and those that did not (rejected; counted in no other field)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
