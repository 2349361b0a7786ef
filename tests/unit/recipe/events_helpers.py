"""What the per-API event encoder tests share: the usage a stream reports and a full turn's segments."""

from __future__ import annotations

from libs.recipe.segments import Content, Reasoning, Segment, ToolCallArgs, ToolCallStart, Usage

USAGE = Usage(prompt_tokens=12, completion_tokens=7, cached_tokens=5, reasoning_tokens=3)
# Reasoning, text, then two tool calls. The second call's arguments are left open: each API's
# tests end the turn their own way (Messages with empty arguments, Responses with more text).
THINK_SAY_CALL: list[Segment] = [
    Reasoning("Let me"),
    Reasoning(" think"),
    Content("It is "),
    Content("sunny."),
    ToolCallStart(0, "call_a", "get_weather"),
    ToolCallArgs(0, '{"city": '),
    ToolCallArgs(0, '"Paris"}'),
    ToolCallStart(1, "call_b", "get_time"),
]
