"""API request models: Chat Completions, Completions, Responses and Messages bodies, validated
into one ``Conversation`` (or a prompt, for Completions). Pure: no I/O, no model knowledge."""

from libs.recipe.api.chat import ChatRequest, parse_chat_request
from libs.recipe.api.completions import CompletionRequest, parse_completion_request
from libs.recipe.api.messages import MessagesRequest, parse_count_tokens_request, parse_messages_request
from libs.recipe.api.responses import ResponsesRequest, parse_responses_request

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "MessagesRequest",
    "ResponsesRequest",
    "parse_chat_request",
    "parse_completion_request",
    "parse_count_tokens_request",
    "parse_messages_request",
    "parse_responses_request",
]
