"""OpenAI Responses request body -> a validated ``ResponsesRequest``. Pure.

The request holds its input as messages; ``conversation(history)`` builds the Conversation, so
the gateway can chain ``previous_response_id`` by passing the earlier response's messages (their
tool calls may be what this input's function_call_output items answer). ``instructions`` are a
leading system message of this request only, never part of the history it leaves behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from libs.recipe.api.common import (
    OutputFormat,
    build_conversation,
    check_fields,
    check_tool_turns,
    json_object,
    json_schema_format,
    metadata,
    model_name,
    optional_dict,
    optional_str,
    regex_format,
    reject_present,
    require_json_word,
    resolve_thinking,
)
from libs.recipe.api.responses_input import WORDING, parse_input
from libs.recipe.api.tools import ToolChoiceSpec, parse_tools, resolve_tool_choice, tool_definition
from libs.recipe.conversation import Conversation, Effort, Message, ToolChoice, ToolDefinition
from libs.recipe.fields import ApiError, boolean, optional_int, shown
from libs.recipe.sampling import MAX_TOP_LOGPROBS, Sampling, parse_sampling

FIELDS = (
    "model", "input", "instructions", "tools", "tool_choice", "text", "reasoning", "max_output_tokens",
    "max_tool_calls", "temperature", "top_p", "top_logprobs", "stream", "stream_options", "background",
    "store", "previous_response_id", "metadata", "parallel_tool_calls", "include", "truncation", "user",
    "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier", "prompt",
    "conversation",
)  # fmt: skip
UNSUPPORTED = ("prompt", "conversation")  # stored prompt templates; server-side conversations


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    model: str
    input_messages: tuple[Message, ...]
    input_origins: tuple[int, ...]  # per input message, the index of its input item (error params)
    instructions: str | None
    tools: tuple[ToolDefinition, ...]  # after tool_choice: only the named one; none for "none"
    tool_choice: ToolChoice
    thinking: bool | None
    effort: Effort | None
    output_format: OutputFormat
    sampling: Sampling
    stream: bool
    background: bool
    store: bool
    previous_response_id: str | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    include: tuple[str, ...]
    truncation: str
    user: str | None
    max_output_tokens: int | None
    echoed: dict[str, Any] = field(default_factory=dict)  # what ``echo`` returns, as validated

    def conversation(self, history: tuple[Message, ...] = ()) -> Conversation:
        """instructions (as system) + ``history`` + this input, checked as one conversation."""
        lead = (Message("system", self.instructions),) if self.instructions is not None else ()
        messages = lead + history + self.input_messages
        offset = len(lead) + len(history)

        def where(i: int) -> str | None:
            if i < offset:
                return None if i < len(lead) else "previous_response_id"
            return f"input[{self.input_origins[i - offset]}]"

        check_tool_turns(messages, where, WORDING)
        require_json_word(
            messages,
            self.output_format,
            "Response input messages must contain the word 'json' in some form to use 'text.format' "
            "of type 'json_object'.",
            "text.format",
        )
        return build_conversation(
            messages,
            thinking=self.thinking,
            effort=self.effort,
            tool_choice=self.tool_choice,
            tools=self.tools,
            output=self.output_format,
        )

    def echo(self) -> dict[str, Any]:
        """The request settings a Response object repeats back, with OpenAI's defaults filled in."""
        return dict(self.echoed)


def _tool(tool: Any, where: str) -> ToolDefinition:
    """One Responses tool: a flat function (built-in tools such as web_search are refused)."""
    if not isinstance(tool, dict):
        raise ApiError(400, f"'{where}' must be an object", param=where)
    kind = tool.get("type")
    if not isinstance(kind, str):
        raise ApiError(400, f"'{where}.type' is required and must be a string", param=f"{where}.type")
    if kind != "function":
        raise ApiError(
            400,
            f"tools of type {shown(kind)} are not supported",
            param=f"{where}.type",
            code="unsupported_parameter",
        )
    get = tool.get
    return tool_definition(get("name"), get("description"), get("parameters"), get("strict"), where)


def _tool_choice(choice: Any) -> ToolChoiceSpec:
    if choice is None:
        return ToolChoiceSpec("auto")
    if choice in ("none", "auto", "required"):
        return ToolChoiceSpec(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return ToolChoiceSpec("required", name=choice["name"])
    raise ApiError(
        400,
        "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
        param="tool_choice",
    )


def _output_format(text: dict[str, Any]) -> OutputFormat:
    spec = text.get("format")
    if spec is None:
        return OutputFormat()
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind in ("text", "json_object"):
        return OutputFormat(kind)
    if kind == "json_schema":
        return json_schema_format(spec, "text.format")  # type: ignore[arg-type]
    if kind == "regex":
        return regex_format(spec, "text.format")  # type: ignore[arg-type]
    raise ApiError(
        400,
        "'text.format.type' must be one of 'text', 'json_object', 'json_schema'",
        param="text.format.type",
    )


def _sampling(body: dict[str, Any], include: tuple[str, ...]) -> Sampling:
    # Responses spells these differently; validate under their own names, then reuse Chat's reader.
    max_output_tokens = optional_int(body, "max_output_tokens", 1)
    top_logprobs = optional_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    chat_body = {
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_tokens": max_output_tokens,
        "logprobs": "message.output_text.logprobs" in include or bool(top_logprobs),
        "top_logprobs": top_logprobs,
    }
    return parse_sampling(chat_body)


def _strings(body: dict[str, Any], key: str) -> tuple[str, ...]:
    value = body.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ApiError(400, f"'{key}' must be an array of strings", param=key)
    return tuple(value)


def _enum(body: dict[str, Any], key: str, allowed: tuple[str, ...], default: str) -> str:
    value = body.get(key, default) if body.get(key) is not None else default
    if value not in allowed:
        raise ApiError(400, f"'{key}' must be one of {', '.join(map(repr, allowed))}", param=key)
    return str(value)


def _reasoning(body: dict[str, Any]) -> tuple[dict[str, Any], bool | None, Effort | None]:
    reasoning = optional_dict(body, "reasoning") or {}
    allowed = ("effort", "summary", "generate_summary")
    check_fields(reasoning, allowed, lambda key: f"Unknown parameter: '{key}'.", "reasoning.")
    summary = optional_str(reasoning, "summary", "reasoning.summary")
    if summary not in (None, "auto", "concise", "detailed", "none"):
        raise ApiError(
            400, "'reasoning.summary' must be 'auto', 'concise' or 'detailed'", param="reasoning.summary"
        )
    thinking, effort = resolve_thinking(None, reasoning.get("effort"), "reasoning.effort")
    return {"effort": reasoning.get("effort"), "summary": summary}, thinking, effort


def _echo(
    body: dict[str, Any], text: dict[str, Any], reasoning: dict[str, Any], sampling: Sampling
) -> dict[str, Any]:
    """The settings a Response object repeats back, as the client sent them or OpenAI's defaults."""
    text_echo: dict[str, Any] = {"format": text.get("format") or {"type": "text"}}
    if text.get("verbosity") is not None:
        text_echo["verbosity"] = text["verbosity"]
    return {
        "instructions": body.get("instructions"),
        "tools": list(body.get("tools") or []),
        "tool_choice": body.get("tool_choice") or "auto",
        "text": text_echo,
        "reasoning": reasoning,
        "temperature": sampling.base.temperature,
        "top_p": sampling.base.top_p,
        "top_logprobs": sampling.base.top_logprobs,
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "store": body.get("store") is not False,
        "metadata": metadata(body),
        "max_output_tokens": sampling.max_tokens,
        "previous_response_id": body.get("previous_response_id"),
        "truncation": body.get("truncation") or "disabled",
        "background": bool(body.get("background")),
        "user": body.get("user"),
    }


def _check_types(body: dict[str, Any]) -> None:
    for key in ("parallel_tool_calls", "store"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise ApiError(400, f"'{key}' must be a boolean", param=key)
    for key in ("instructions", "previous_response_id", "user", "safety_identifier", "prompt_cache_key"):
        optional_str(body, key)
    optional_int(body, "max_tool_calls", 1)
    _enum(body, "truncation", ("auto", "disabled"), "disabled")


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Validate a Responses body. Without ``previous_response_id`` the input is checked as a whole
    conversation here; with one, its tool results may answer history, so ``conversation`` checks."""
    body = json_object(body)
    check_fields(body, FIELDS, lambda key: f"Unknown parameter: '{key}'.")
    model = model_name(body)
    reject_present(body, UNSUPPORTED)
    _check_types(body)
    messages, origins = parse_input(body.get("input"))
    reasoning, thinking, effort = _reasoning(body)
    tool_choice, tools = resolve_tool_choice(
        _tool_choice(body.get("tool_choice")), parse_tools(body, _tool), thinking
    )
    text = optional_dict(body, "text") or {}
    include = _strings(body, "include")
    sampling = _sampling(body, include)
    request = ResponsesRequest(
        model=model,
        input_messages=messages,
        input_origins=origins,
        instructions=body.get("instructions"),
        tools=tools,
        tool_choice=tool_choice,
        thinking=thinking,
        effort=effort,
        output_format=_output_format(text),
        sampling=sampling,
        stream=boolean(body, "stream"),
        background=boolean(body, "background"),
        store=body.get("store") is not False,  # OpenAI stores responses unless told not to
        previous_response_id=body.get("previous_response_id"),
        metadata=metadata(body),
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        include=include,
        truncation=body.get("truncation") or "disabled",
        user=body.get("user"),
        max_output_tokens=sampling.max_tokens,
        echoed=_echo(body, text, reasoning, sampling),
    )
    if request.previous_response_id is None:
        request.conversation()  # fail fast: nothing earlier can answer or open a tool call
    return request
