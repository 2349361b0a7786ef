"""End-to-end throughput: output tokens/s through HTTP (the whole stack) vs the same model loop in
one process (ModelRunner called directly, no bus, no HTTP), at concurrency 1 and 8.

    python bench/e2e.py [--dtype bfloat16|float32] [--max-tokens 64]

Prints one line per concurrency with both rates and their ratio (stack / in-process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from deepinfer.serve import is_healthy
from deepinfer.settings import resolve_cache_dir
from libs.bus.nats_server import free_port
from libs.models.gguf_loader import load_llama
from libs.models.llama import LlamaForCausalLM
from libs.models.registry import resolve_model_path
from libs.protocol.codec import pack_tokens, unpack_tokens
from libs.protocol.messages import NewSequence, SamplingParams, SchedulerOutput
from libs.recipe.chat_template import ChatTemplate
from libs.recipe.tokenizer import Tokenizer
from services.worker.model_runner import KVLayout, ModelRunner

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "Write a short story about a robot.",
    "Explain how rain forms.",
    "Describe the city of Paris.",
    "What makes a good friend?",
    "Tell me about the history of tea.",
    "How do airplanes fly?",
    "Describe a walk in the forest.",
    "Why is the sky blue?",
]


def in_process(model: LlamaForCausalLM, prompts: list[list[int]], max_tokens: int, eos: int) -> float:
    """Greedy generation of all prompts as one batch, stopping each on EOS or max_tokens; tokens/s."""
    cfg, dtype = model.config, model.dtype
    layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    runner = ModelRunner(model, layout, 2048, 16, dtype)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    new = tuple(NewSequence(f"s{i}", pack_tokens(p), params) for i, p in enumerate(prompts))
    out = runner.execute(SchedulerOutput(1, new))
    counts = dict.fromkeys(out.seq_ids, 1)
    running = [s for s, t in zip(out.seq_ids, unpack_tokens(out.sampled_token_ids), strict=True) if t != eos]
    step, finished = 1, tuple(s for s in out.seq_ids if s not in running)
    while running:
        step += 1
        out = runner.execute(SchedulerOutput(step, (), tuple(running), finished))
        finished = ()
        for seq_id, token in zip(out.seq_ids, unpack_tokens(out.sampled_token_ids), strict=True):
            counts[seq_id] += 1
            if token == eos or counts[seq_id] >= max_tokens:
                running.remove(seq_id)
                finished += (seq_id,)
    return sum(counts.values()) / (time.perf_counter() - start)


async def through_http(base_url: str, prompts: list[str], max_tokens: int, concurrency: int) -> float:
    async def one(http: httpx.AsyncClient, prompt: str) -> int:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with http.stream("POST", "/chat/completions", json=body) as resp:
            last = ""
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    last = line
        return int(json.loads(last[6:])["usage"]["completion_tokens"])

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        await one(http, "Hi")  # warm-up
        start = time.perf_counter()
        counts = []
        for i in range(0, len(prompts), concurrency):
            counts += await asyncio.gather(*(one(http, p) for p in prompts[i : i + concurrency]))
        return sum(counts) / (time.perf_counter() - start)


def start_stack(port: int, dtype: str, cache_dir: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deepinfer",
                "serve",
                "--port",
                str(port),
                "--dtype",
                dtype,
                "--cache-dir",
                cache_dir,
                "--log-level",
                "warning",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if is_healthy(f"http://127.0.0.1:{port}/health"):
            return proc
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(log.read_text()[-2000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    cache_dir = resolve_cache_dir("", os.environ)
    tok = Tokenizer.from_gguf(resolve_model_path(), Path(cache_dir))
    assert tok.chat_template is not None and tok.eos_token_id is not None
    template = ChatTemplate(tok.chat_template)
    ids = [tok.encode(template.render([{"role": "user", "content": p}])) for p in PROMPTS]
    model = load_llama(resolve_model_path(), Path(cache_dir), dtype=getattr(torch, args.dtype))
    # concurrency 1: the first two prompts one after the other; 8: all eight together
    solo = [in_process(model, [p], args.max_tokens, tok.eos_token_id) for p in ids[:2]]
    results = {
        1: [2 / sum(1 / r for r in solo)],
        8: [in_process(model, ids, args.max_tokens, tok.eos_token_id)],
    }
    del model
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_stack(port, args.dtype, cache_dir, Path(tmp) / "serve.log")
        try:
            base = f"http://127.0.0.1:{port}/v1"
            results[1].append(asyncio.run(through_http(base, PROMPTS[:2], args.max_tokens, 1)))
            results[8].append(asyncio.run(through_http(base, PROMPTS, args.max_tokens, 8)))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    print(f"dtype={args.dtype} max_tokens={args.max_tokens} threads={torch.get_num_threads()}")
    for conc, (local, http) in results.items():
        print(
            f"concurrency {conc}: in-process {local:7.1f} tok/s | HTTP stack {http:7.1f} tok/s | "
            f"ratio {http / local:.2f}"
        )


if __name__ == "__main__":
    main()
