"""``deepinfer serve --tensor-parallel-size 2 --num-workers 2``: each worker is a group of two
rank processes (gloo). Greedy completions through the stack equal one rank's (a TP=1 worker in
this process, fp32), and kill -9 of a rank mid-stream takes its worker out: the stream moves to
the other worker and ends with every token once, and the lost worker is restarted. The tiny
DeepSeek-V3 over two expert-parallel ranks answers as transformers does."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from deepinfer.local_engine import LocalEngine
from libs.modelfiles.registry import resolve_model_path
from libs.models.tiny_deepseek import deepseek_v4_tokenizer_dir, write_tiny_checkpoint
from libs.protocol.messages import SamplingParams
from libs.recipe.tokenizer import Tokenizer
from services.scheduler.limits import Limits
from services.worker.config import Config
from services.worker.main import build_worker
from tests.deepseek_reference import hf_from_dir, hf_greedy
from tests.system.serve_proc import MODEL, Serve, free_ports, scrape, serving
from tests.system.test_serve_cli import HEAL_S, READY_S

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
)
LONG_PROMPT = 2  # the one the kill interrupts
MAX_TOKENS = (24, 24, 64)


def _one_rank_greedy(prompts: list[list[int]], cache_dir: Path) -> list[list[int]]:
    """What a TP=1 worker (this process) answers, greedy, fp32."""
    config = Config(dtype="float32", kv_cache_gb=0.05, host_cache_gb=0, kv_store_path="none")
    worker = build_worker(config, str(cache_dir), profile=False)
    try:
        runner = worker.runner
        limits = Limits(runner.kv_cache.num_blocks, runner.block_size, 4, 2048, 256, 16)
        engine = LocalEngine(runner, limits, eos_token_id=2)
        for i, (prompt, max_tokens) in enumerate(zip(prompts, MAX_TOKENS, strict=True)):
            engine.add(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        outputs = engine.run()
        return [outputs[str(i)] for i in range(len(prompts))]
    finally:
        worker.close()


def _complete(serve: Serve, prompt: list[int], max_tokens: int) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(f"{serve.url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    text: str = resp.json()["choices"][0]["text"]
    return text


def _stream(serve: Serve, prompt: list[int], max_tokens: int, chunks: list[dict[str, object]]) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{serve.url}/v1/completions", json=body, timeout=180) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: ") :]))


def _ranks_of(worker: psutil.Process) -> list[psutil.Process]:
    return [p for p in worker.children() if "services.worker.rank" in " ".join(p.cmdline())]


def test_tensor_parallel_stack(model_cache_dir: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_gguf(resolve_model_path("smollm2"), model_cache_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    expected = [tokenizer.decode(tokens) for tokens in _one_rank_greedy(prompts, model_cache_dir)]
    port = free_ports(6)
    flags = ("--tensor-parallel-size", "2", "--num-workers", "2", "--metrics-port", str(port))
    with serving(model_cache_dir, tmp_path, *flags, ready_s=READY_S) as serve:
        serve.wait_until(
            "two workers of two ranks", lambda: len(serve.children("services.worker.rank")) == 2, 60
        )
        serve.wait_until("an answer", serve.answers, HEAL_S)
        for prompt, max_tokens, want in zip(prompts, MAX_TOKENS, expected, strict=True):
            assert _complete(serve, prompt, max_tokens) == want

        chunks: list[dict[str, object]] = []
        reader = threading.Thread(target=_stream, args=(serve, prompts[LONG_PROMPT], 64, chunks))
        reader.start()
        serve.wait_until("the stream's first tokens", lambda: len(chunks) >= 4, 60)
        # The worker that holds the stream (worker metrics ports: port and port + 4).
        holding = [p for p in (port, port + 4) if scrape(p)[("deepinfer_worker_num_running_seqs", ())] == 1]
        assert len(holding) == 1
        worker = next(
            w
            for w in serve.children("deepinfer worker")
            if f"--metrics-port {holding[0]}" in " ".join(w.cmdline())
        )
        (rank,) = _ranks_of(worker)
        rank.kill()
        killed_at = time.monotonic()
        reader.join(120)
        assert not reader.is_alive()
        text = "".join(str(c["choices"][0]["text"]) for c in chunks if "choices" in c)  # type: ignore[index]
        assert not [c for c in chunks if "error" in c], chunks[-3:]
        assert text == expected[LONG_PROMPT]  # every token once, across the move
        log = serve.text()
        assert f"tensor-parallel group broken (rank 1 (pid {rank.pid}) exited with code -9)" in log
        assert "exited (code 71): restarting it" in log
        serve.wait_until(
            "the lost worker back, with two ranks",
            lambda: len(serve.children("services.worker.rank")) == 2,
            HEAL_S,
        )
        assert time.monotonic() - killed_at < HEAL_S


def test_expert_parallel_deepseek_stack(model_cache_dir: Path, tmp_path: Path) -> None:
    """The tiny DeepSeek-V3 over two expert-parallel ranks through the stack: greedy tokens equal
    transformers' on the same checkpoint (as one rank's do: tests/system/test_deepseek_stack.py)."""
    checkpoint = tmp_path / "tiny-deepseek"
    write_tiny_checkpoint(checkpoint, seed=7, tokenizer_dir=deepseek_v4_tokenizer_dir())
    flags = ("--model", str(checkpoint), "--chat-format", "deepseek-v4.1")
    flags += ("--tensor-parallel-size", "2", "--expert-parallel", "true")
    with serving(model_cache_dir, tmp_path, *flags, ready_s=READY_S) as serve:
        assert len(serve.children("services.worker.rank")) == 1
        prompt = [100, 2000, 30000, 77, 128000, 5]
        body = {"model": "tiny-deepseek", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        resp = httpx.post(f"{serve.url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
    tokenizer = Tokenizer.from_hf_dir(checkpoint)
    tokens = hf_greedy(hf_from_dir(checkpoint), prompt, 8, tokenizer.eos_token_id)
    assert resp.json()["choices"][0]["text"] == tokenizer.decode(tokens)


def test_a_rank_lost_while_loading_takes_its_worker_out(model_cache_dir: Path) -> None:
    """A rank killed before the worker has joined the bus: the worker exits 71 (the group is
    broken) at once, not after a timeout, and leaves no rank behind."""
    argv = [sys.executable, "-m", "deepinfer", "worker", "--tensor-parallel-size", "2"]
    argv += ["--dtype", "float32", "--cache-dir", str(model_cache_dir), "--nats-url", "nats://127.0.0.1:9"]
    worker = subprocess.Popen(argv)
    try:
        deadline = time.monotonic() + 60
        while not (ranks := _ranks_of(psutil.Process(worker.pid))):
            assert time.monotonic() < deadline and worker.poll() is None
            time.sleep(0.1)
        ranks[0].kill()
        assert worker.wait(30) == 71
    finally:
        worker.kill()
