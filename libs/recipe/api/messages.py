"""Anthropic Messages request body -> a validated ``MessagesRequest`` holding one Conversation. Pure.

Anthropic's semantics where they differ from the wheel's: ``max_tokens`` is required,
``temperature`` is in [0, 1], ``tool_choice: any`` means a call is required, and a final assistant
message is a prefill the model continues (``prefix``). ``/v1/messages/count_tokens`` bodies use
``parse_count_tokens_request``: the same, without ``max_tokens``.

Top-level ``cache_control: {type: ephemeral, ttl}`` becomes ``MessagesRequest.cache_retention``, its
ttl (Anthropic's default "5m" when it names none), which the gateway reads as a retention class of
the prefix cache; the cache itself is always on, so block-level ``cache_control`` markers are
accepted and have nothing to add. Fields that steer Anthropic's own service (speed, inference_geo,
service_tier, diagnostics) are validated and inert, or refused saying why: docs/sdk-compat.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from libs.recipe.api.common import (
    OutputFormat,
    build_conversation,
    check_fields,
    json_object,
    model_name,
    reject_present,
    resolve_thinking,
    thinking_type,
)
from libs.recipe.api.inert import anthropic_options, strict_object
from libs.recipe.api.messages_content import parse_messages, system_text
from libs.recipe.api.tools import ToolChoiceSpec, parse_tools, resolve_tool_choice, tool_definition
from libs.recipe.conversation import Conversation, Message, ToolDefinition
from libs.recipe.fields import (
    INT32_MAX,
    ApiError,
    boolean,
    check_depth,
    number,
    optional_bool,
    optional_dict,
    optional_int,
    optional_str,
)
from libs.recipe.sampling import Sampling, build_sampling

FIELDS = (
    "model", "messages", "max_tokens", "system", "tools", "tool_choice", "thinking", "output_config",
    "stop_sequences", "temperature", "top_p", "top_k", "metadata", "stream", "service_tier",
    "container", "mcp_servers", "context_management", "cache_control", "diagnostics", "inference_geo",
    "speed",
)  # fmt: skip
UNSUPPORTED = {
    "container": "no code execution containers run here: use client tools",
    "mcp_servers": "this server connects to no MCP servers: send their tools as client tools",
    "context_management": "context editing is not done here: trim the messages before sending them",
}
UNKNOWN = "{}: Extra inputs are not permitted".format
CACHE_TTLS = ("5m", "1h")
DEFAULT_CACHE_TTL = "5m"  # Anthropic's, for a cache_control that names no ttl


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    model: str
    conversation: Conversation
    sampling: Sampling  # its max_tokens is required for /v1/messages; None only for count_tokens
    stream: bool
    cache_retention: str | None = None  # top-level cache_control's ttl: the gateway maps it to a class


def _tool(tool: Any, where: str) -> ToolDefinition:
    """One Messages tool: a custom tool with an ``input_schema`` (server tools are refused)."""
    if not isinstance(tool, dict):
        raise ApiError(400, f"{where}: Input should be an object", param=where)
    if tool.get("type", "custom") != "custom":  # web_search_20250305, bash_..., text_editor_...
        raise ApiError(400, f"{where}: server tools are not supported", param=f"{where}.type")
    if not isinstance(tool.get("input_schema"), dict):
        raise ApiError(400, f"{where}.input_schema: Field required", param=f"{where}.input_schema")
    # Anthropic's strict only closes objects; optional properties stay optional.
    return tool_definition(tool, where, "input_schema", require_all=False)


def _tool_choice(body: dict[str, Any]) -> ToolChoiceSpec:
    choice = optional_dict(body, "tool_choice")
    if choice is None:
        return ToolChoiceSpec("auto")
    optional_bool(
        choice,
        "disable_parallel_tool_use",
        "tool_choice",
        "tool_choice.disable_parallel_tool_use: Input should be a valid boolean",
    )
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return ToolChoiceSpec(kind)
    if kind == "any":
        return ToolChoiceSpec("required")  # Anthropic: the model must use one of the tools
    if kind == "tool" and isinstance(choice.get("name"), str):
        return ToolChoiceSpec("required", name=choice["name"])
    raise ApiError(
        400, "tool_choice: must be {type: auto|any|none} or {type: tool, name}", param="tool_choice"
    )


def _max_tokens(body: dict[str, Any], required: bool) -> int | None:
    if required and body.get("max_tokens") is None:
        raise ApiError(400, "max_tokens: Field required", param="max_tokens")
    return optional_int(body, "max_tokens", 1, INT32_MAX)


def _thinking(body: dict[str, Any], max_tokens: int | None) -> bool | None:
    thinking = body.get("thinking")
    enabled = thinking_type(thinking, "thinking")
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
    if budget is not None:
        # Accepted for compatibility and otherwise ignored: the formats have no thinking budget.
        ok = type(budget) is int and budget >= 1024 and (max_tokens is None or budget < max_tokens)
        if not ok:
            raise ApiError(
                400,
                "thinking.budget_tokens: must be an integer >= 1024 and less than max_tokens",
                param="thinking.budget_tokens",
            )
    return enabled


def _sampling(body: dict[str, Any], max_tokens: int | None) -> Sampling:
    """Anthropic's sampling fields, under Anthropic's names and ranges (temperature in [0, 1])."""
    temperature = number(body, "temperature", 1.0, 0.0, 1.0)
    top_p = number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = optional_int(body, "top_k", 0, INT32_MAX) or 0
    stop = body.get("stop_sequences")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "stop_sequences: Input should be a valid list of strings", param="stop_sequences")
    return build_sampling(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_tokens=max_tokens,
        stop=[s for s in stop or [] if s],
    )


def _output_config(body: dict[str, Any]) -> tuple[Any, OutputFormat]:
    """(effort, output format) from output_config: text, or a json_schema."""
    config = optional_dict(body, "output_config") or {}
    allowed = ("effort", "format")
    check_fields(config, allowed, UNKNOWN, "output_config.")
    fmt = optional_dict(config, "format", "output_config.format")
    if fmt is None:
        return config.get("effort"), OutputFormat()
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError(
            400,
            "output_config.format: must be {type: json_schema, schema: {...}}",
            param="output_config.format",
        )
    check_depth(fmt["schema"], "output_config.format.schema")
    return config.get("effort"), OutputFormat("json_schema", schema=fmt["schema"])


def _cache_ttl(body: dict[str, Any]) -> str | None:
    """Top-level ``cache_control``'s ttl ("5m" when it names none); None without one."""
    control = strict_object(body, "cache_control", ("type", "ttl"), UNKNOWN)
    if control is None:
        return None
    if control.get("type") != "ephemeral":
        raise ApiError(400, "cache_control.type: Input should be 'ephemeral'", param="cache_control.type")
    ttl = control.get("ttl")
    if ttl is None:
        return DEFAULT_CACHE_TTL
    if not isinstance(ttl, str) or ttl not in CACHE_TTLS:
        raise ApiError(400, "cache_control.ttl: Input should be '5m' or '1h'", param="cache_control.ttl")
    return ttl


def _request(body: Any, max_tokens_required: bool) -> MessagesRequest:
    body = json_object(body)
    check_fields(body, FIELDS, UNKNOWN)
    model = model_name(body)
    reject_present(body, UNSUPPORTED)
    max_tokens = _max_tokens(body, max_tokens_required)
    system = system_text(body.get("system"))
    messages: tuple[Message, ...] = ((Message("system", system),) if system else ()) + parse_messages(
        body.get("messages")
    )
    effort_value, output = _output_config(body)
    # Anthropic's effort shapes all output, thinking or not: it does not switch thinking on.
    thinking, effort = resolve_thinking(
        _thinking(body, max_tokens), effort_value, "output_config.effort", effort_implies_thinking=False
    )
    tool_choice, tools = resolve_tool_choice(
        _tool_choice(body), parse_tools(body, _tool, "tools: Input should be a valid list"), thinking
    )
    meta = optional_dict(body, "metadata") or {}
    optional_str(meta, "user_id", "metadata.user_id")  # accepted, and unused
    anthropic_options(body, UNKNOWN)
    conversation = build_conversation(
        messages, thinking=thinking, effort=effort, tool_choice=tool_choice, tools=tools, output=output
    )
    return MessagesRequest(
        model=model,
        conversation=conversation,
        sampling=_sampling(body, max_tokens),
        stream=boolean(body, "stream"),
        cache_retention=_cache_ttl(body),
    )


def parse_messages_request(body: Any) -> MessagesRequest:
    """Validate a /v1/messages body (400 naming the offending field on bad input)."""
    return _request(body, max_tokens_required=True)


def parse_count_tokens_request(body: Any) -> MessagesRequest:
    """Validate a /v1/messages/count_tokens body: a Messages body whose max_tokens is optional.
    Its cache_control is validated and inert: counting stores nothing in the cache."""
    return replace(_request(body, max_tokens_required=False), cache_retention=None)
