"""Golden prompts end to end: an API request body through our adapter and our DeepSeek V4.1 / V4
renderer equals the deepseek-recipe wheel's conversion and rendering, byte for byte, for Chat
Completions, Responses and Messages (the corpus of test_api_oracle: bodies both accept)."""

from __future__ import annotations

from typing import Any

import pytest

from libs.recipe.api import parse_chat_request, parse_messages_request, parse_responses_request
from libs.recipe.deepseek_v4 import DeepSeekV4Format
from tests.unit.recipe.test_api_oracle import CHAT, MESSAGES, RESPONSES

dr = pytest.importorskip("deepseek_recipe")

VERSIONS = {
    "v4.1": ("DeepSeek-V4.1-Flash", "DeepseekV41Encoding"),
    "v4": ("DeepSeek-V4-Pro", "DeepseekV4Encoding"),
}
KINDS = {
    "chat": (CHAT, parse_chat_request, "ChatCompletionRequest"),
    "responses": (RESPONSES, parse_responses_request, "ResponsesRequest"),
    "messages": (MESSAGES, parse_messages_request, "MessagesRequest"),
}
CASES = [(kind, name, v) for kind, (corpus, _, _) in KINDS.items() for name in corpus for v in VERSIONS]


@pytest.mark.parametrize(("kind", "name", "version"), CASES)
def test_request_renders_like_the_wheel(kind: str, name: str, version: str) -> None:
    corpus, parse, wheel_class = KINDS[kind]
    model, encoding = VERSIONS[version]
    body: dict[str, Any] = {**corpus[name], "model": model}
    if kind == "messages":
        # Anthropic requires it (the wheel does not), above any thinking.budget_tokens in the corpus.
        body.setdefault("max_tokens", 65536)
    converted = getattr(dr, wheel_class)(body).convert(dr.ConversionOptions())
    theirs = getattr(dr, encoding)().render_conversation(converted.conversation)
    request = parse(body)
    conversation = request.conversation() if kind == "responses" else request.conversation
    ours = DeepSeekV4Format(version).render(conversation)  # type: ignore[arg-type]
    assert ours.text == theirs.prompt
    assert list(ours.special_ranges) == [tuple(r) for r in theirs.special_ranges]
