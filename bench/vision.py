"""Images on this machine: the encoder's time per image, and what the encoder cache saves a request.

    python bench/vision.py            # a ViT-B/16-sized tower (224 px, 196 tokens), SmolLM2-shaped text
    python bench/vision.py --quick    # the tiny test checkpoint (tests/unit/models/test_bench_vision.py)

Part **encode** (in process, ``services/encoder``'s ImageEncoder on the checkpoint): ms per image
to decode and preprocess a PNG, and the vision tower + projector's forward at batch 1 and batch 4
(baseline: batch 1). Part **ttft** (``deepinfer serve`` on the checkpoint, streaming Chat, one
request at a time): the time to the first token of a request whose image is new (the encoder runs
and the whole prompt is prefilled: the baseline), of one whose image was seen before behind other
text (an encoder cache hit, the prefix cache misses), and of one repeated whole (both hit); and
for scale, a text-only request of the same length. The weights are random (no VLM ships offline
here): the times are those of real shapes, the text is noise.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from PIL import Image

from libs.modelfiles.llava_config import read_llava_config
from libs.models.llava_loader import load_llava_vision
from libs.models.tiny_llava import write_tiny_llava
from libs.runtime.settings import resolve_cache_dir
from services.encoder.image_encoder import ImageEncoder

# A CLIP ViT-B/16 tower (86M parameters) and a SmolLM2-135M-shaped language model, random.
FULL_SHAPE = {
    "vision_config": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
    },
    "text_config": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
    },
}


def checkpoint(quick: bool) -> Path:
    """The bench's checkpoint, written once under the user's cache dir."""
    name = "llava-tiny" if quick else "llava-vitb16-smollm2-shape"
    directory = Path(resolve_cache_dir("", os.environ)) / "bench" / name
    if not (directory / "model.safetensors").is_file():
        if quick:
            write_tiny_llava(directory, seed=0)
        else:
            write_tiny_llava(directory, seed=0, image_size=224, patch_size=16, shape=FULL_SHAPE)
    return directory


def png(seed: int, size: tuple[int, int] = (640, 480)) -> bytes:
    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def timed_ms(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def part_encode(directory: Path, repeats: int) -> None:
    config = read_llava_config(directory)
    tower = load_llava_vision(directory, torch.float32)
    encoder = ImageEncoder(tower, config.image_processing, torch.device("cpu"), torch.float32, 16)
    files = [png(seed) for seed in range(4)]
    pixels = [encoder.pixel_values(f) for f in files]
    preprocess = timed_ms(lambda: encoder.pixel_values(files[0]), repeats)
    one = timed_ms(lambda: encoder.encode(pixels[:1]), repeats)
    four = timed_ms(lambda: encoder.encode(pixels), repeats) / 4
    print(f"\n## encode ({config.num_image_tokens} tokens an image, {torch.get_num_threads()} threads)")
    print("| step | ms per image | vs batch 1 |\n|---|---|---|")
    print(f"| decode + preprocess a 640x480 PNG | {preprocess:.1f} | |")
    print(f"| tower + projector, batch 1 | {one:.1f} | 1.00x |")
    print(f"| tower + projector, batch 4 | {four:.1f} | {one / four:.2f}x faster |")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serving(directory: Path, port: int, tmp: Path) -> Iterator[str]:
    argv = [sys.executable, "-m", "deepinfer", "serve", "--model", str(directory), "--port", str(port)]
    argv += ["--dtype", "float32", "--kv-cache-gb", "0.5", "--host-cache-gb", "0", "--kv-store-path", "none"]
    argv += ["--media-path", str(tmp / "media"), "--max-num-seqs", "4", "--served-model-name", "llava"]
    log = (tmp / "serve.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline, last = time.monotonic() + 300, "no answer"
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                log_tail = (tmp / "serve.log").read_text()[-3000:]
                raise RuntimeError(f"serve did not answer an image request ({last}): {log_tail}")
            try:
                resp = httpx.post(f"{url}/v1/chat/completions", json=request(png(99), "warm-up"), timeout=120)
                if resp.status_code == 200:
                    break
                last = f"{resp.status_code} {resp.text[:200]}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(1)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)  # serve stops its services and its nats-server
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def request(image: bytes | None, system: str, text: str = "Describe the picture.") -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    if image is not None:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        parts.append({"type": "image_url", "image_url": {"url": url}})
    parts.append({"type": "text", "text": text})
    messages = [{"role": "system", "content": system}, {"role": "user", "content": parts}]
    return {"model": "llava", "messages": messages, "max_tokens": 2, "temperature": 0, "stream": True}


def ttft_ms(url: str, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return (time.perf_counter() - started) * 1e3
    raise RuntimeError(f"no token: {resp.status_code}")


def part_ttft(directory: Path, repeats: int, num_image_tokens: int) -> None:
    with (
        tempfile.TemporaryDirectory(prefix="bench-vision-") as tmp,
        serving(directory, free_port(), Path(tmp)) as url,
    ):
        rows: dict[str, list[float]] = {"cold": [], "encoder hit": [], "both hit": [], "text only": []}
        filler = " ".join(["word"] * num_image_tokens)  # the text-only prompt as long as the image
        for i in range(repeats):
            image = png(1000 + i)
            rows["cold"].append(ttft_ms(url, request(image, f"Session {i}.")))
            rows["encoder hit"].append(ttft_ms(url, request(image, f"Another session {i}.")))
            rows["both hit"].append(ttft_ms(url, request(image, f"Another session {i}.")))
            rows["text only"].append(ttft_ms(url, request(None, f"Text session {i}.", filler)))
    cold = statistics.median(rows["cold"])
    print(f"\n## ttft (median of {repeats}, ms; streaming Chat, one request at a time)")
    print("| request | TTFT ms | vs cold |\n|---|---|---|")
    for name, times in rows.items():
        median = statistics.median(times)
        print(f"| {name} | {median:.1f} | {median / cold:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny checkpoint, 2 repeats")
    parser.add_argument("--repeats", type=int, default=0, help="timed runs per figure (default 10; 2 quick)")
    parser.add_argument("--parts", default="encode,ttft")
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 10)
    directory = checkpoint(args.quick)
    config = read_llava_config(directory)
    print(f"# vision bench: {directory.name}, load average {os.getloadavg()[0]:.2f}")
    print(json.dumps({"vision": dataclasses.asdict(config.vision), "text_hidden": config.text.hidden_size}))
    if "encode" in args.parts:
        part_encode(directory, repeats)
    if "ttft" in args.parts:
        part_ttft(directory, repeats, config.num_image_tokens)


if __name__ == "__main__":
    main()
