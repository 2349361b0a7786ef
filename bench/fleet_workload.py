"""The routing part's agent workload (bench/fleet.py): each session's own system prompt of tool
descriptions and its tool results, and each worker's G1 sized to it.

The shape is a coding agent's: a short system prompt and tool results of a few hundred tokens (a
file read), so most of a turn's context is what earlier turns returned. Answers are exactly
``reply_tokens`` long (the requests set ``ignore_eos``), so the contexts' sizes are known before the
run and G1 is sized to them, not to a bound some runs never reach.
"""

from __future__ import annotations

import math
from pathlib import Path

from libs.modelfiles.gguf_metadata import read_gguf_config
from libs.modelfiles.registry import resolve_model_path
from libs.recipe.chat_template import render_chat
from libs.recipe.tokenizer import Tokenizer

NUM_TOOLS = 8  # per session's system prompt: ~230 tokens in SmolLM2's vocabulary
NUM_RESULT_LINES = 5  # per tool result: ~140 tokens
# Each worker's G1, in its fair share of the sessions' longest contexts. 1.0: the fleet's G1 holds
# every conversation once, as its working set; the hit-rate ratio falls as it grows (see kv_cache_gb).
CACHE_SHARE = 1.0


def system_prompt(session: int) -> str:
    """Each session its own tools: sessions share no prompt blocks, as agents on different tasks."""
    tools = " ".join(
        f"Tool {i}: {name}_{session}_{i}(query: string, limit: integer) returns the rows of kind {i}."
        for i, name in enumerate(["search", "fetch", "lookup", "list"] * (NUM_TOOLS // 4))
    )
    return f"You are agent number {session}, working on project {session * 7919 % 10007}. {tools}"


def tool_result(session: int, turn: int) -> str:
    """A file the agent's last tool read, distinct per session and turn."""
    lines = "\n".join(
        f"{n:3d}    row_{session}_{turn}_{n} = load(table={n % 5}, key={session * 1000 + turn * 50 + n})"
        for n in range(NUM_RESULT_LINES)
    )
    return (
        f"Tool result, file data_{session}_{turn}.py:\n{lines}\n"
        "Summarize the file in one sentence, then name the next tool."
    )


def longest_context_tokens(tokenizer: Tokenizer, num_sessions: int, num_turns: int, reply_tokens: int) -> int:
    """The tokens of a session's last prompt, the largest over the sessions: its conversation
    rendered by the model's chat template, with each earlier answer's ``reply_tokens`` added (the
    requests set ``ignore_eos``: every answer is that long)."""
    assert tokenizer.chat_template is not None, "the model has no chat template"
    longest = 0
    for session in range(num_sessions):
        messages = [{"role": "system", "content": system_prompt(session)}]
        for turn in range(num_turns):
            if turn:
                messages.append({"role": "assistant", "content": ""})
            messages.append({"role": "user", "content": tool_result(session, turn)})
        prompt = render_chat(tokenizer.chat_template, messages)
        longest = max(longest, len(tokenizer.encode(prompt)) + (num_turns - 1) * reply_tokens)
    return longest


def kv_bytes_per_token(model: str, dtype: str) -> int:
    """The bytes of one token's KV in G1 (every layer's keys and values)."""
    config = read_gguf_config(resolve_model_path(model))
    element_size = 4 if dtype == "float32" else 2
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element_size


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
    tokenizer = Tokenizer.from_gguf(resolve_model_path(model), Path(cache_dir))
    sessions_per_worker = math.ceil(num_sessions / num_workers)
    num_tokens = (
        CACHE_SHARE
        * sessions_per_worker
        * longest_context_tokens(tokenizer, num_sessions, num_turns, reply_tokens)
    )
    return round(num_tokens * kv_bytes_per_token(model, dtype) / 2**30, 4)
