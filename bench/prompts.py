"""The chat prompts every engine in bench/throughput.py and bench/llamacpp_baseline.py decodes."""

from __future__ import annotations

from libs.recipe.conversation import Conversation, Message
from services.gateway.served_model import ServedModel

ASKS = (
    "Write a short story about",
    "Explain in simple words",
    "Give three facts about",
    "Describe the history of",
    "Write a poem about",
    "List the pros and cons of",
    "Tell a child about",
    "Summarize what people know about",
)
TOPICS = (
    "a robot learning to paint.",
    "how rain forms.",
    "the city of Paris.",
    "friendship between neighbours.",
    "tea and where it comes from.",
    "how airplanes fly.",
    "a walk in an old forest.",
    "why the sky is blue.",
)


def bench_prompts(count: int) -> list[str]:
    """`count` distinct user messages of similar length (so batched left padding stays small)."""
    prompts = []
    for i in range(count):
        ask, topic = ASKS[i % len(ASKS)], TOPICS[(i // len(ASKS) + i) % len(TOPICS)]
        suffix = f" (take {i // 64 + 1})" if i >= 64 else ""
        prompts.append(f"{ask} {topic}{suffix}")
    return prompts


def chat_prompts(served: ServedModel, count: int) -> list[list[int]]:
    """Token ids exactly as the gateway makes them from one user message."""
    return [served.prompt(Conversation((Message("user", p),))).token_ids for p in bench_prompts(count)]
