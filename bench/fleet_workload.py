"""The routing part's agent workload (bench/fleet.py): each session's own system prompt of tool
descriptions and its tool results, and each worker's G1 sized to it."""

from __future__ import annotations

import math
from pathlib import Path

from libs.models.gguf_metadata import read_gguf_config
from libs.models.registry import resolve_model_path
from libs.recipe.tokenizer import Tokenizer

NUM_TOOLS = 12  # per session's system prompt: ~300 tokens
CACHE_SHARE = 1.1  # each worker's G1, in its fair share of the sessions' longest contexts
TEMPLATE_TOKENS = 8  # a chat template's tokens around one message, at most


def system_prompt(session: int) -> str:
    """Each session its own tools: sessions share no prompt blocks, as agents on different tasks."""
    tools = " ".join(
        f"Tool {i}: {name}_{session}_{i}(query: string, limit: integer) returns the rows of kind {i}."
        for i, name in enumerate(["search", "fetch", "lookup", "list"] * (NUM_TOOLS // 4))
    )
    return f"You are agent number {session}, working on project {session * 7919 % 10007}. {tools}"


def tool_result(session: int, turn: int) -> str:
    rows = ", ".join(f'{{"id": {session * 1000 + turn * 10 + i}, "value": "item {i}"}}' for i in range(6))
    return f"Tool result: [{rows}]. Summarize these rows in one sentence, then name the next tool."


def longest_context_tokens(tokenizer: Tokenizer, num_sessions: int, num_turns: int, reply_tokens: int) -> int:
    """The tokens of a session's last turn with every reply at its longest (a bound: the chat
    template's few tokens per message are covered by ``TEMPLATE_TOKENS``)."""
    longest = 0
    for session in range(num_sessions):
        texts = [system_prompt(session), *(tool_result(session, t) for t in range(num_turns))]
        num_tokens = sum(len(tokenizer.encode_plain(t)) for t in texts)
        num_tokens += (num_turns - 1) * reply_tokens + (2 * num_turns + 1) * TEMPLATE_TOKENS
        longest = max(longest, num_tokens)
    return longest


def kv_cache_gb(
    model: str,
    cache_dir: str,
    dtype: str,
    num_workers: int,
    num_sessions: int,
    num_turns: int,
    reply_tokens: int,
) -> float:
    """Each worker's G1: ``CACHE_SHARE`` x its fair share of the sessions' longest contexts. Every
    conversation fits in the fleet's cache only if each stays on one worker: the regime routing is
    for (where any worker holds every conversation, a random pick hits as well, and the ratio says
    nothing)."""
    path = resolve_model_path(model)
    config = read_gguf_config(path)
    tokenizer = Tokenizer.from_gguf(path, Path(cache_dir))
    sessions_per_worker = math.ceil(num_sessions / num_workers)
    num_tokens = (
        CACHE_SHARE
        * sessions_per_worker
        * longest_context_tokens(tokenizer, num_sessions, num_turns, reply_tokens)
    )
    element_size = 4 if dtype == "float32" else 2
    bytes_per_token = (
        2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element_size
    )
    return round(num_tokens * bytes_per_token / 2**30, 4)
