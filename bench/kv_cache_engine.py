"""The engine floor of bench/kv_cache.py: the worker's ModelRunner alone, in this process, no stack.

    python bench/kv_cache_engine.py                                   # the embedded model, CPU
    python bench/kv_cache_engine.py --model llama-3-8b --device cuda  # random weights on a GPU

One ~4k-token prompt cold, then with its cached prefix's KV already in the device pages (the G1
case, the floor of every tier), then the time to fill those blocks from G2 (host memory) and from
G3 (block files written by a save, read back without prefetch): each tier's TTFT is the floor plus
its load. On CPU the runner is the worker's own (``build_runner`` on the model's GGUF); on CUDA
the model is built on the device with random weights of the spec's shape (the worker itself serves
on CPU only so far) and the host pool is pinned, as a CUDA worker's would be.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from random_model import EMBEDDED, gguf_path, model_config, random_model

from libs.kvstore.block_file import BlockLayout
from libs.kvstore.retention import RetentionPolicy
from libs.modelfiles.gguf_metadata import read_gguf_config
from libs.protocol.codec import pack_tokens
from libs.protocol.kv_messages import KVSave, join_hashes
from libs.protocol.messages import NewSequence, SamplingParams, SchedulerOutput
from libs.runtime.settings import resolve_cache_dir
from services.worker.config import Config
from services.worker.host_cache import HostCache
from services.worker.kv_cache import element_size
from services.worker.kv_store import KVStore
from services.worker.kv_tiers import KVTiers
from services.worker.model_runner import ModelRunner, ModelShape


def make_runner(
    spec: str, dtype: str, device: str, num_tokens: int, block_size: int, cache_dir: str
) -> ModelRunner:
    """A runner with device pages for ``num_tokens`` tokens (the prompt, then the load targets)."""
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    if device == "cpu":
        path = gguf_path(spec, cache_dir)
        config = read_gguf_config(path)
    else:
        path, config = None, model_config("smollm2" if spec == EMBEDDED else spec)
    shape = ModelShape.of(config)
    num_blocks = -(-num_tokens // block_size) + 8
    if path is not None:
        kv_cache_gb = (
            num_blocks * shape.kv_spec.bytes_per_block(block_size, element_size(torch_dtype)) / 2**30
        )
        worker = Config(model=str(path), dtype=dtype, kv_cache_gb=kv_cache_gb, block_size=block_size)
        from services.worker.main import build_runner  # the worker process's imports: CPU only

        return build_runner(worker, cache_dir)[0]
    model = random_model(config, torch_dtype, device)
    return ModelRunner(model, shape, num_blocks, block_size, torch_dtype, device=device)


def engine_floor(
    spec: str,
    dtype: str,
    device: str,
    prompt: list[int],
    num_cached: int,
    repeats: int,
    tmp: Path,
    cache_dir: str,
) -> dict[str, float]:
    """Seconds: cold prefill, G1 prefill (the floor), and the G2 / G3 loads of the cached blocks."""
    block_size = 16
    num_pages = -(-len(prompt) // block_size)
    num_blocks = num_cached // block_size
    runner = make_runner(spec, dtype, device, (num_pages + num_blocks) * block_size, block_size, cache_dir)
    on_cuda = device.startswith("cuda")

    def sync() -> None:  # a GPU runs ahead of the host: wait for it before reading the clock
        if on_cuda:
            torch.cuda.synchronize()

    pages = list(range(num_pages))
    greedy = SamplingParams(max_tokens=1, temperature=0)

    def timed(fn: Callable[[], object]) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    def prefill(seq_id: str, num_computed: int) -> float:
        new = NewSequence(
            seq_id,
            pack_tokens(prompt),
            b"",
            greedy,
            (0,),
            pack_tokens(pages),
            num_computed,
            len(prompt) - num_computed,
        )
        elapsed = timed(lambda: runner.execute(SchedulerOutput(1, new_seqs=(new,))))
        runner.execute(SchedulerOutput(2, finished_seq_ids=(seq_id,)))
        return elapsed

    prefill("warm-up", 0)  # first-call costs (allocator, kernel selection) out of the way
    out = {"cold": statistics.median(prefill(f"cold{i}", 0) for i in range(max(2, repeats // 2)))}
    out["G1"] = statistics.median(prefill(f"g1-{i}", num_cached) for i in range(repeats))
    kv, kv_spec = runner.kv_cache, runner.kv_cache.kv_spec
    block_layout = BlockLayout(kv_spec, block_size)
    hashes = [random.Random(i).randbytes(32) for i in range(num_blocks)]
    host = HostCache(num_blocks, kv_spec.block_shape(block_size), kv.dtype, pin_memory=on_cuda)

    def store() -> KVStore:
        return KVStore(tmp / "engine-store", "bench", block_layout, kv.dtype, RetentionPolicy())

    tiers = KVTiers(host, store())
    tiers.save(kv, KVSave(pack_tokens(pages[:num_blocks]), join_hashes(hashes)))
    tiers.flush()
    targets = list(range(num_pages, num_pages + num_blocks))  # other pages than the saved ones

    def load(from_tiers: KVTiers) -> None:
        loaded = from_tiers.load(kv, targets, hashes)
        assert loaded.num_loaded_blocks == num_blocks, loaded

    out["G2 load"] = statistics.median(timed(lambda: load(tiers)) for _ in range(repeats))
    out["G3 load"] = statistics.median(timed(lambda: load(KVTiers(None, store()))) for _ in range(repeats))
    return out


def print_engine(result: dict[str, float], setup: str, num_tokens: int, num_cached: int) -> None:
    cold, floor = result["cold"], result["G1"]
    print(f"\nengine only ({setup}): {num_tokens} tokens, {num_cached} cached")
    print(f"  cold {cold * 1e3:.1f} ms; G1 (the floor) {floor * 1e3:.1f} ms = {floor / cold:.3f}x")
    for name in ("G2", "G3"):
        seconds = result[f"{name} load"]
        total = floor + seconds
        print(
            f"  {name}: load of {num_cached // 16} blocks {seconds * 1e3:.1f} ms -> "
            f"{total * 1e3:.1f} ms = {total / cold:.3f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=EMBEDDED, help="as bench/kv_cache.py's --model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cache-dir", default=resolve_cache_dir("", os.environ))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    num_cached = int(args.prompt_tokens * 0.9) // 16 * 16  # whole blocks, as the stack's cache keeps
    prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
    with tempfile.TemporaryDirectory() as tmp:
        result = engine_floor(
            args.model, args.dtype, args.device, prompt, num_cached, args.repeats, Path(tmp), args.cache_dir
        )
    where = args.device if args.device != "cpu" else f"cpu, {args.threads} threads"
    print_engine(result, f"{args.model}, {args.dtype}, {where}", len(prompt), num_cached)


if __name__ == "__main__":
    main()
