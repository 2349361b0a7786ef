"""OpenAI Chat Completions request body -> a validated ``ChatRequest`` holding one Conversation. Pure.

Extensions accepted beside OpenAI's fields: DeepSeek's ``thinking: {type}``, assistant
``reasoning_content`` / ``prefix`` and the ``latest_reminder`` role; vLLM's sampling extras (see
``sampling``) and ``chat_template_kwargs`` (-> ``Conversation.extra``); and a regex output
constraint spelled ``response_format: {"type": "regex", "regex": "..."}`` (the wheel's spelling;
vLLM's ``guided_regex`` is not accepted). An unknown top-level field is a 400, as at OpenAI.
``prompt_cache_retention`` is passed on as sent; ``prompt_cache_key`` is validated and unused.
``prediction`` (Predicted Outputs) becomes ``ChatRequest.prediction``, its text. Fields that steer
OpenAI's own service (store, service_tier, moderation, prompt_cache_options...) are validated and
inert, or refused saying why: docs/sdk-compat.md has the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from libs.recipe.api.chat_messages import parse_messages
from libs.recipe.api.common import (
    build_conversation,
    check_fields,
    include_usage,
    json_object,
    metadata,
    model_name,
    one_of,
    output_format,
    prompt_cache_retention,
    reject_present,
    require_json_word,
    resolve_thinking,
    thinking_type,
)
from libs.recipe.api.inert import CHAT_PROMPT_CACHE_KEYS, moderation, prompt_cache_options
from libs.recipe.api.tools import ToolChoiceSpec, parse_tools, resolve_tool_choice, tool_definition
from libs.recipe.conversation import Conversation, ToolDefinition
from libs.recipe.fields import ApiError, boolean, optional_bool, optional_dict, optional_str
from libs.recipe.sampling import Sampling, parse_sampling

OPENAI_FIELDS = (
    "model", "messages", "frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens",
    "max_tokens", "metadata", "modalities", "moderation", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop", "store",
    "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
    "verbosity", "audio", "function_call", "functions", "web_search_options",
)  # fmt: skip
EXTENSION_FIELDS = (
    "thinking", "chat_template_kwargs",  # DeepSeek / vLLM
    "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",  # vLLM sampling
)  # fmt: skip
# Known, but not implemented: a 400 that says why beats silently ignoring them.
UNSUPPORTED = {
    "audio": "this server generates text only (modalities: ['text'])",
    "functions": "the deprecated functions API is not served: send 'tools' instead",
    "function_call": "the deprecated functions API is not served: send 'tool_choice' instead",
    "web_search_options": "no web search runs here: give the model a function tool that searches",
}
UNKNOWN = "Unrecognized request argument supplied: {}".format


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    conversation: Conversation
    sampling: Sampling
    stream: bool
    include_usage: bool
    cache_retention: str | None = None  # prompt_cache_retention as sent: the gateway maps it
    prediction: str = ""  # Predicted Outputs: the text the output is expected to be ("": none)


def _tool(tool: Any, where: str) -> ToolDefinition:
    """One Chat tool: a function nested under ``function``."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ApiError(400, f"'{where}.type' must be 'function'", param=f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ApiError(400, f"'{where}.function' must be an object", param=f"{where}.function")
    return tool_definition(function, f"{where}.function")


def tool_choice_spec(choice: Any) -> ToolChoiceSpec:
    if choice is None:
        return ToolChoiceSpec("auto")
    if choice in ("none", "auto", "required"):
        return ToolChoiceSpec(choice)
    function = choice.get("function") if isinstance(choice, dict) else None
    if (
        not isinstance(function, dict)
        or choice.get("type") != "function"
        or not isinstance(function.get("name"), str)
    ):
        raise ApiError(
            400,
            "'tool_choice' must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    return ToolChoiceSpec("required", name=function["name"])


def _extra(body: dict[str, Any]) -> dict[str, Any]:
    kwargs = optional_dict(body, "chat_template_kwargs") or {}
    if not all(isinstance(key, str) for key in kwargs):
        raise ApiError(400, "'chat_template_kwargs' keys must be strings", param="chat_template_kwargs")
    return dict(kwargs)


def _check_modalities(body: dict[str, Any]) -> None:
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        why = "'modalities' must be ['text']: only the 'text' output modality is supported"
        raise ApiError(400, why, param="modalities")


def _conversation(body: dict[str, Any]) -> Conversation:
    messages = parse_messages(body.get("messages"))
    thinking, effort = resolve_thinking(
        thinking_type(body.get("thinking"), "thinking"), body.get("reasoning_effort"), "reasoning_effort"
    )
    tool_choice, tools = resolve_tool_choice(
        tool_choice_spec(body.get("tool_choice")), parse_tools(body, _tool), thinking
    )
    output = output_format(optional_dict(body, "response_format"), "response_format", nested=True)
    require_json_word(
        messages,
        output,
        "Prompt must contain the word 'json' in some form to use 'response_format' of type 'json_object'.",
        "messages",
    )
    return build_conversation(
        messages,
        thinking=thinking,
        effort=effort,
        tool_choice=tool_choice,
        tools=tools,
        output=output,
        extra=_extra(body),
    )


def _prediction(body: dict[str, Any]) -> str:
    """``prediction: {"type": "content", "content": str | [{"type": "text", "text": str}, ...]}``."""
    prediction = optional_dict(body, "prediction")
    if prediction is None:
        return ""
    check_fields(prediction, ("type", "content"), UNKNOWN, prefix="prediction.")
    if prediction.get("type") != "content":
        raise ApiError(400, "'prediction.type' must be 'content'", param="prediction.type")
    content = prediction.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        why = "'prediction.content' must be a string or an array of text parts"
        raise ApiError(400, why, param="prediction.content")
    texts = []
    for i, part in enumerate(content):
        where = f"prediction.content[{i}]"
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"'{where}' must be a part of type 'text' with a string 'text'", param=where)
        check_fields(part, ("type", "text"), UNKNOWN, prefix=f"{where}.")
        texts.append(part["text"])
    return "".join(texts)


def _check_unused(body: dict[str, Any]) -> None:
    """Fields accepted and validated, though nothing here acts on them: parallel_tool_calls (not
    enforced), user, safety_identifier, metadata and store (nothing is kept for OpenAI's products),
    service_tier, verbosity (the model has no such control), moderation, prompt_cache_options."""
    optional_bool(body, "parallel_tool_calls")
    optional_str(body, "user")
    optional_str(body, "safety_identifier")
    metadata(body)
    boolean(body, "store")
    optional_str(body, "service_tier")
    one_of(body, "verbosity", ("low", "medium", "high"))
    moderation(body, UNKNOWN)
    prompt_cache_options(body, UNKNOWN, CHAT_PROMPT_CACHE_KEYS)


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a Chat Completions body (400 naming the offending field on bad input)."""
    body = json_object(body)
    check_fields(body, OPENAI_FIELDS + EXTENSION_FIELDS, UNKNOWN)
    model = model_name(body)
    reject_present(body, UNSUPPORTED)
    _check_modalities(body)
    conversation = _conversation(body)
    _check_unused(body)
    return ChatRequest(
        model=model,
        conversation=conversation,
        sampling=parse_sampling(body),
        stream=boolean(body, "stream"),
        include_usage=include_usage(body),
        cache_retention=prompt_cache_retention(body),
        prediction=_prediction(body),
    )
