"""OpenAI Responses request body -> a validated ``ResponsesRequest``. Pure.

The request holds its input as messages; ``conversation(history)`` builds the Conversation, so
the gateway can chain ``previous_response_id`` by passing the earlier response's messages (their
tool calls may be what this input's function_call_output items answer). ``instructions`` are a
leading system message of this request only, never part of the history it leaves behind. Fields
that steer OpenAI's own service (service_tier, moderation, access_programs, context_management...)
are validated and inert, or refused saying why: docs/sdk-compat.md has the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from libs.recipe.api.common import (
    OutputFormat,
    build_conversation,
    check_fields,
    check_tool_turns,
    json_object,
    metadata,
    model_name,
    output_format,
    prompt_cache_retention,
    reject_present,
    require_json_word,
    resolve_thinking,
)
from libs.recipe.api.inert import (
    RESPONSES_PROMPT_CACHE_KEYS,
    access_programs,
    background_options,
    context_management,
    image_options,
    moderation,
    prompt_cache_options,
    responses_stream_options,
)
from libs.recipe.api.openai_content import client_text
from libs.recipe.api.responses_input import WORDING, parse_input
from libs.recipe.api.tools import ToolChoiceSpec, parse_tools, resolve_tool_choice, tool_definition
from libs.recipe.conversation import Conversation, Effort, Message, ToolChoice, ToolDefinition
from libs.recipe.fields import (
    ApiError,
    boolean,
    number,
    optional_bool,
    optional_dict,
    optional_int,
    optional_str,
    shown,
)
from libs.recipe.sampling import MAX_TOP_LOGPROBS, Sampling, build_sampling

FIELDS = (
    "model", "input", "instructions", "tools", "tool_choice", "text", "reasoning", "max_output_tokens",
    "max_tool_calls", "temperature", "top_p", "top_logprobs", "stream", "stream_options", "background",
    "store", "previous_response_id", "metadata", "parallel_tool_calls", "include", "truncation", "user",
    "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier", "prompt",
    "conversation", "access_programs", "background_options", "context_management", "image", "moderation",
    "prompt_cache_options",
)  # fmt: skip
UNSUPPORTED = {
    "prompt": "stored prompt templates are not kept here: send its text as 'instructions' and 'input'",
    # Accepting it would drop the conversation's earlier items from the prompt without a word.
    "conversation": "server-side conversations are not kept here: chain turns with 'previous_response_id' "
    "or send the history in 'input'",
}
UNKNOWN = "Unknown parameter: '{}'.".format


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
    echoed: dict[str, Any] = field(default_factory=dict)  # what ``echo`` returns, as validated
    # Without previous_response_id: the conversation, built (and so checked) as the body was parsed.
    checked: Conversation | None = None
    cache_retention: str | None = None  # prompt_cache_retention as sent: the gateway maps it

    def conversation(self, history: tuple[Message, ...] = ()) -> Conversation:
        """instructions (as system) + ``history`` + this input, checked as one conversation."""
        if not history and self.checked is not None:
            return self.checked
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
    return tool_definition(tool, where)


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


def _sampling(body: dict[str, Any], include: tuple[str, ...]) -> Sampling:
    """Responses' sampling fields, under their own names (max_output_tokens, include for logprobs)."""
    max_output_tokens = optional_int(body, "max_output_tokens", 1)
    top_logprobs = optional_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    return build_sampling(
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_output_tokens,
        logprobs="message.output_text.logprobs" in include or top_logprobs > 0,
        top_logprobs=top_logprobs,
    )


def _strings(body: dict[str, Any], key: str) -> tuple[str, ...]:
    value = body.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ApiError(400, f"'{key}' must be an array of strings", param=key)
    return tuple(value)


def _enum(body: dict[str, Any], key: str, allowed: tuple[str, ...], default: str) -> str:
    value = body.get(key)
    if value is None:
        return default
    if value not in allowed:
        raise ApiError(400, f"'{key}' must be one of {', '.join(map(repr, allowed))}", param=key)
    return str(value)


def _reasoning(body: dict[str, Any]) -> tuple[dict[str, Any], bool | None, Effort | None]:
    reasoning = optional_dict(body, "reasoning") or {}
    allowed = ("effort", "summary", "generate_summary")
    check_fields(reasoning, allowed, UNKNOWN, "reasoning.")
    summary = optional_str(reasoning, "summary", "reasoning.summary")
    if summary not in (None, "auto", "concise", "detailed", "none"):
        raise ApiError(
            400, "'reasoning.summary' must be 'auto', 'concise' or 'detailed'", param="reasoning.summary"
        )
    thinking, effort = resolve_thinking(None, reasoning.get("effort"), "reasoning.effort")
    return {"effort": reasoning.get("effort"), "summary": summary}, thinking, effort


def _check_unused(body: dict[str, Any]) -> None:
    """Fields accepted and validated, though nothing here acts on them (docs/sdk-compat.md says why
    each is inert): max_tool_calls bounds built-in tools, of which there are none here."""
    optional_str(body, "safety_identifier")
    optional_str(body, "service_tier")
    optional_int(body, "max_tool_calls", 1)
    moderation(body, UNKNOWN)
    prompt_cache_options(body, UNKNOWN, RESPONSES_PROMPT_CACHE_KEYS)
    access_programs(body, UNKNOWN)
    background_options(body, UNKNOWN)
    image_options(body, UNKNOWN)
    context_management(body, UNKNOWN)
    responses_stream_options(body, UNKNOWN)


def _settings(body: dict[str, Any]) -> dict[str, Any]:
    """The top-level settings a Response repeats back, each validated once, with OpenAI's defaults
    filled in."""
    instructions = optional_str(body, "instructions")
    return {
        "instructions": None if instructions is None else client_text(instructions, "instructions"),
        "parallel_tool_calls": optional_bool(body, "parallel_tool_calls") is not False,
        "store": optional_bool(body, "store") is not False,  # OpenAI stores responses unless told not to
        "metadata": metadata(body),
        "previous_response_id": optional_str(body, "previous_response_id"),
        "truncation": _enum(body, "truncation", ("auto", "disabled"), "disabled"),
        "background": boolean(body, "background"),
        "user": optional_str(body, "user"),
    }


def _echo(
    body: dict[str, Any],
    settings: dict[str, Any],
    text: dict[str, Any],
    reasoning: dict[str, Any],
    sampling: Sampling,
) -> dict[str, Any]:
    """The settings a Response object repeats back, as the client sent them or OpenAI's defaults."""
    text_echo: dict[str, Any] = {"format": text.get("format") or {"type": "text"}}
    if text.get("verbosity") is not None:
        text_echo["verbosity"] = text["verbosity"]
    return {
        "instructions": settings["instructions"],
        "tools": list(body.get("tools") or []),
        "tool_choice": body.get("tool_choice") or "auto",
        "text": text_echo,
        "reasoning": reasoning,
        "temperature": sampling.base.temperature,
        "top_p": sampling.base.top_p,
        "top_logprobs": sampling.base.top_logprobs,
        "parallel_tool_calls": settings["parallel_tool_calls"],
        "store": settings["store"],
        "metadata": settings["metadata"],
        "max_output_tokens": sampling.max_tokens,
        "previous_response_id": settings["previous_response_id"],
        "truncation": settings["truncation"],
        "background": settings["background"],
        "user": settings["user"],
        "prompt_cache_key": optional_str(body, "prompt_cache_key"),
        "prompt_cache_retention": optional_str(body, "prompt_cache_retention"),
    }


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Validate a Responses body. Without ``previous_response_id`` the input is checked as a whole
    conversation here (and kept); with one, its tool results may answer history, so ``conversation``
    checks."""
    body = json_object(body)
    check_fields(body, FIELDS, UNKNOWN)
    model = model_name(body)
    reject_present(body, UNSUPPORTED)
    _check_unused(body)
    settings = _settings(body)
    messages, origins = parse_input(body.get("input"))
    reasoning, thinking, effort = _reasoning(body)
    tool_choice, tools = resolve_tool_choice(
        _tool_choice(body.get("tool_choice")), parse_tools(body, _tool), thinking
    )
    text = optional_dict(body, "text") or {}
    sampling = _sampling(body, _strings(body, "include"))
    request = ResponsesRequest(
        model=model,
        input_messages=messages,
        input_origins=origins,
        instructions=settings["instructions"],
        tools=tools,
        tool_choice=tool_choice,
        thinking=thinking,
        effort=effort,
        output_format=output_format(text.get("format"), "text.format"),
        sampling=sampling,
        stream=boolean(body, "stream"),
        background=settings["background"],
        store=settings["store"],
        previous_response_id=settings["previous_response_id"],
        echoed=_echo(body, settings, text, reasoning, sampling),
        cache_retention=prompt_cache_retention(body),
    )
    if request.previous_response_id is None:
        # Fail fast (nothing earlier can answer or open a tool call), and keep it for the gateway.
        request = replace(request, checked=request.conversation())
    return request
