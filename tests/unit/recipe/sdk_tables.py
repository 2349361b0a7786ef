"""What each parameter of the pinned SDKs' create methods means here, per route: honoured, inert (a
documented no-op), or refused with a 400 saying why; each with a valid value to send. The tables
are read by test_sdk_params.py against the SDKs' own signatures, and docs/sdk-compat.md words them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from libs.protocol.messages import TokenBias

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
CHAT_TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
FLAT_TOOL = {"type": "function", "name": "f", "parameters": SCHEMA}
CLAUDE_TOOL = {"name": "f", "input_schema": SCHEMA}


@dataclass(frozen=True)
class Honoured:
    value: Any  # valid, and unlike what the parser reads without it
    also: dict[str, Any] = field(default_factory=dict)  # what it needs beside it (in both bodies)
    wire: str | None = None  # the body field the SDK sends it as, when not its own name
    effect: Callable[[Any], bool] | None = None  # a check of the parsed request, where one says more


@dataclass(frozen=True)
class Inert:
    value: Any
    also: dict[str, Any] = field(default_factory=dict)
    header: str | None = None  # the SDK sends it as this header, never in the body


@dataclass(frozen=True)
class Refused:
    value: Any
    why: str  # a fragment of the 400's reason


Kind = Honoured | Inert | Refused


def _biased(request: Any) -> bool:
    return bool(request.sampling.base.logit_bias == (TokenBias(42, 5.0),))


def _retention(value: str) -> Callable[[Any], bool]:
    return lambda request: bool(request.cache_retention == value)


class Answer(BaseModel):
    a: str


CHAT: dict[str, Kind] = {
    "messages": Honoured([{"role": "user", "content": "Hello"}]),
    "model": Honoured("another-model"),
    "audio": Refused({"voice": "alloy", "format": "wav"}, "text only"),
    "frequency_penalty": Honoured(0.5),
    "function_call": Refused("auto", "'tool_choice'"),
    "functions": Refused([{"name": "f", "parameters": SCHEMA}], "'tools'"),
    "logit_bias": Honoured({"42": 5}, effect=_biased),
    "logprobs": Honoured(True),
    "max_completion_tokens": Honoured(5),
    "max_tokens": Honoured(5),
    "metadata": Inert({"k": "v"}),
    "modalities": Inert(["text"]),  # what is produced anyway; any other is refused
    "moderation": Inert({"model": "omni-moderation-latest", "policy": {"input": {"mode": "score"}}}),
    "n": Honoured(2),
    "parallel_tool_calls": Inert(False),
    "prediction": Honoured({"type": "content", "content": "Hi there"}),
    "presence_penalty": Honoured(0.5),
    "prompt_cache_key": Inert("tenant-a"),
    "prompt_cache_options": Inert({"mode": "explicit", "ttl": "30m"}),
    "prompt_cache_retention": Honoured("24h", effect=_retention("24h")),
    "reasoning_effort": Honoured("high"),
    "response_format": Honoured({"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}),
    "safety_identifier": Inert("user-1"),
    "seed": Honoured(7),
    "service_tier": Inert("flex"),
    "stop": Honoured(["\n"]),
    "store": Inert(True),
    "stream": Honoured(True),
    "stream_options": Honoured({"include_usage": True}, also={"stream": True}),
    "temperature": Honoured(0.5),
    "tool_choice": Honoured("required", also={"tools": [CHAT_TOOL]}),
    "tools": Honoured([CHAT_TOOL]),
    "top_logprobs": Honoured(2, also={"logprobs": True}),
    "top_p": Honoured(0.5),
    "user": Inert("user-1"),
    "verbosity": Inert("low"),
    "web_search_options": Refused({"search_context_size": "low"}, "no web search"),
}

COMPLETIONS: dict[str, Kind] = {
    "model": Honoured("another-model"),
    "prompt": Honoured("Hello"),
    "best_of": Inert(2, also={"n": 2}),  # 1 or n: what n gives anyway; more is refused
    "echo": Honoured(True),
    "frequency_penalty": Honoured(0.5),
    "logit_bias": Honoured({"42": 5}, effect=_biased),
    "logprobs": Honoured(2),
    "max_tokens": Honoured(5),
    "n": Honoured(2),
    "presence_penalty": Honoured(0.5),
    "seed": Honoured(7),
    "stop": Honoured(["\n"]),
    "stream": Honoured(True),
    "stream_options": Honoured({"include_usage": True}, also={"stream": True}),
    "suffix": Refused("}", "fill-in-the-middle"),
    "temperature": Honoured(0.5),
    "top_p": Honoured(0.5),
    "user": Inert("user-1"),
}

RESPONSES: dict[str, Kind] = {
    "access_programs": Inert({"cyber": "standard"}),
    "background": Honoured(True),
    "background_options": Inert({"completion_window": "2h", "continuation_id": "batch-1"}),
    "context_management": Inert([{"type": "compaction", "compact_threshold": 100_000}]),
    "conversation": Refused("conv_1", "previous_response_id"),
    "image": Inert({"context_compression": "auto"}),
    "include": Honoured(["message.output_text.logprobs"]),
    "input": Honoured("Hello"),
    "instructions": Honoured("Be brief."),
    "max_output_tokens": Honoured(5),
    "max_tool_calls": Inert(3),
    "metadata": Honoured({"k": "v"}),  # repeated back and kept with the stored response
    "model": Honoured("another-model"),
    "moderation": Inert({"model": "omni-moderation-latest", "policy": {"output": {"mode": "score"}}}),
    "parallel_tool_calls": Inert(False),
    "previous_response_id": Honoured("resp_1"),
    "prompt": Refused({"id": "pmpt_1"}, "stored prompt templates"),
    "prompt_cache_key": Inert("tenant-a"),
    "prompt_cache_options": Inert({"mode": "implicit", "ttl": "12h", "comparison_response_id": "resp_1"}),
    "prompt_cache_retention": Honoured("in_memory", effect=_retention("in_memory")),
    "reasoning": Honoured({"effort": "high"}),
    "safety_identifier": Inert("user-1"),
    "service_tier": Inert("priority"),
    "store": Honoured(False),
    "stream": Honoured(True),
    "stream_options": Inert({"include_obfuscation": False}, also={"stream": True}),
    "temperature": Honoured(0.5),
    "text": Honoured({"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}}),
    "tool_choice": Honoured("required", also={"tools": [FLAT_TOOL]}),
    "tools": Honoured([FLAT_TOOL]),
    "top_logprobs": Honoured(2),
    "top_p": Honoured(0.5),
    "truncation": Inert("auto"),  # nothing is dropped: an over-long input is a 400 either way
    "user": Inert("user-1"),
}

_SHARED_MESSAGES: dict[str, Kind] = {
    "messages": Honoured([{"role": "user", "content": "Hello"}]),
    "model": Honoured("another-model"),
    "output_config": Honoured({"format": {"type": "json_schema", "schema": SCHEMA}}),
    "speed": Inert("fast"),
    "system": Honoured("Be brief."),
    "thinking": Honoured({"type": "adaptive"}),
    "tool_choice": Honoured({"type": "any"}, also={"tools": [CLAUDE_TOOL]}),
    "tools": Honoured([CLAUDE_TOOL]),
    "user_profile_id": Inert("prof_1", header="anthropic-user-profile-id"),
    "workspace_id": Inert("wrkspc_1", header="anthropic-workspace-id"),
}

MESSAGES: dict[str, Kind] = {
    **_SHARED_MESSAGES,
    "max_tokens": Honoured(5),
    "cache_control": Honoured({"type": "ephemeral", "ttl": "1h"}, effect=_retention("1h")),
    "container": Refused("container_1", "no code execution containers"),
    "diagnostics": Inert({"previous_message_id": "msg_1"}),
    "inference_geo": Inert("us"),
    "metadata": Inert({"user_id": "user-1"}),
    "service_tier": Inert("standard_only"),
    "stop_sequences": Honoured(["\n"]),
    "stream": Honoured(True),
}

COUNT_TOKENS: dict[str, Kind] = {
    **_SHARED_MESSAGES,
    "cache_control": Inert({"type": "ephemeral", "ttl": "1h"}),  # counting stores nothing
    "output_format": Honoured(
        Answer,
        wire="output_config",
        effect=lambda request: request.conversation.response_format == "json_schema",
    ),
}
