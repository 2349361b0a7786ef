"""Images through the whole stack: ``deepinfer serve --model DIR`` on a tiny random LLaVA checkpoint
starts an encoder beside the worker; every API takes images; greedy tokens and their logprobs equal
transformers' LlavaForConditionalGeneration on the same checkpoint (fp32, logprobs within 1e-4),
with the prompt prefilled in chunks that cut through the image's tokens and its KV blocks; the same
image hits the encoder cache and the prefix cache, a different one shares only the text before it;
bad images are 400s in each API's shape while a stream beside them goes on; a killed encoder
comes back. The text is noise (random weights); the path is real."""

from __future__ import annotations

import base64
import concurrent.futures
import functools
import http.server
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from libs.models.tiny_llava import IMAGE_TOKEN, write_tiny_llava
from libs.recipe.chat_template import render_chat
from libs.recipe.tokenizer import Tokenizer
from tests.system.serve_proc import Serve, free_ports, scrape, serving

NAME = "tiny-llava"
READY_S = 240.0
NUM_IMAGE_TOKENS = 16  # 32x32 pixels in 8x8 patches
BLOCK_SIZE = 16
CHUNK = 20  # prefill chunks of 20 tokens: the image (positions 27-42) spans two, and three blocks


def png(seed: int, size: tuple[int, int] = (50, 40)) -> bytes:
    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def chat_body(*images: str, text: str = "What is this?", **extra: Any) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    parts.append({"type": "text", "text": text})
    return {
        "model": NAME,
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 6,
        "temperature": 0,
        **extra,
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llava(tmp_path_factory.mktemp("models") / NAME, seed=3)


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    """A local HTTP server with one image at /cat.png (the allowed URL host)."""
    body = png(11)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = self.path == "/cat.png"
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            if found:
                self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_ports(5)  # worker, scheduler, kvcache, encoder


@pytest.fixture(scope="module")
def serve(
    model_cache_dir: Path, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory, metrics_port: int
) -> Iterator[Serve]:
    tmp = tmp_path_factory.mktemp("vision-serve")
    with serving(
        model_cache_dir,
        tmp,
        *("--model", str(checkpoint), "--served-model-name", NAME, "--media-path", str(tmp / "media")),
        *("--max-num-batched-tokens", str(CHUNK), "--block-size", str(BLOCK_SIZE)),
        *("--image-url-hosts", "127.0.0.1", "--max-image-pixels", str(1 << 20)),
        *("--metrics-port", str(metrics_port)),
        ready_s=READY_S,
    ) as proc:
        proc.wait_until("an encoder", lambda: encodes(proc), READY_S)
        yield proc


def encodes(serve: Serve) -> bool:
    """An image request is answered (the encoder has joined); 503 while none has."""
    resp = httpx.post(f"{serve.url}/v1/chat/completions", json=chat_body(data_url(png(99))), timeout=60)
    assert resp.status_code in (200, 503), resp.text
    return resp.status_code == 200


@functools.cache
def reference(checkpoint: Path, seeds: tuple[int, ...], text: str, num_tokens: int) -> tuple[list[int], Any]:
    """transformers' greedy tokens for a user turn of the images then ``text``, and the
    log-softmax at each generated position: the prompt built from the chat template with the
    model's own image token (the processor's way), not through deepinfer's recipe."""
    from transformers import CLIPImageProcessorPil, LlavaForConditionalGeneration

    tokenizer = Tokenizer.from_hf_dir(checkpoint)
    assert tokenizer.chat_template is not None
    content = "\n\n".join([*(IMAGE_TOKEN for _ in seeds), text])
    ids = tokenizer.encode(render_chat(tokenizer.chat_template, [{"role": "user", "content": content}]))
    image_id = tokenizer.special_id(IMAGE_TOKEN)
    prompt = [t for token in ids for t in ([token] * NUM_IMAGE_TOKENS if token == image_id else [token])]
    model = LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    processor = CLIPImageProcessorPil.from_pretrained(checkpoint)
    images = [Image.open(io.BytesIO(png(seed))) for seed in seeds]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(input_ids=torch.tensor([prompt + tokens]), pixel_values=pixels).logits[0, -1]
            tokens.append(int(logits.argmax()))
        full = model(input_ids=torch.tensor([prompt + tokens]), pixel_values=pixels).logits[0]
    logprobs = torch.log_softmax(full[len(prompt) - 1 : -1].double(), dim=-1)
    return prompt + tokens, logprobs


def test_greedy_tokens_and_logprobs_equal_transformers(serve: Serve, checkpoint: Path) -> None:
    body = chat_body(data_url(png(1)), logprobs=True, top_logprobs=2)
    resp = httpx.post(f"{serve.url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    full, logprobs = reference(checkpoint, (1,), "What is this?", 6)
    tokenizer = Tokenizer.from_hf_dir(checkpoint)
    prompt_len = len(full) - 6
    assert out["usage"]["prompt_tokens"] == prompt_len  # the image counts its 16 tokens
    assert out["choices"][0]["message"]["content"] == tokenizer.decode(full[prompt_len:])
    got = [entry["logprob"] for entry in out["choices"][0]["logprobs"]["content"]]
    want = [float(logprobs[i, t]) for i, t in enumerate(full[prompt_len:])]
    assert np.allclose(got, want, atol=1e-4), (got, want)


def test_two_images_keep_their_order(serve: Serve, checkpoint: Path) -> None:
    tokenizer = Tokenizer.from_hf_dir(checkpoint)
    outputs = []
    for seeds in ((2, 3), (3, 2)):
        body = chat_body(*(data_url(png(s)) for s in seeds), text="Compare them.")
        resp = httpx.post(f"{serve.url}/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        full, _ = reference(checkpoint, seeds, "Compare them.", 6)
        assert resp.json()["choices"][0]["message"]["content"] == tokenizer.decode(full[-6:])
        outputs.append(full[-6:])
    assert outputs[0] != outputs[1]  # the order is seen (else this test proves nothing)


def test_every_api_takes_the_image_and_answers_alike(serve: Serve, image_server: str) -> None:
    image = png(4)
    chat = httpx.post(f"{serve.url}/v1/chat/completions", json=chat_body(data_url(image)), timeout=60)
    assert chat.status_code == 200, chat.text
    want = chat.json()["choices"][0]["message"]["content"]
    b64 = base64.b64encode(image).decode()
    messages = {
        "model": NAME,
        "max_tokens": 6,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
    }
    resp = httpx.post(f"{serve.url}/v1/messages", json=messages, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["content"][0]["text"] == want
    count = httpx.post(f"{serve.url}/v1/messages/count_tokens", json=messages, timeout=60)
    assert count.json()["input_tokens"] == chat.json()["usage"]["prompt_tokens"]
    responses = {
        "model": NAME,
        "max_output_tokens": 6,
        "temperature": 0,
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(image)},
                    {"type": "input_text", "text": "What is this?"},
                ],
            }
        ],
    }
    resp = httpx.post(f"{serve.url}/v1/responses", json=responses, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["output"][0]["content"][0]["text"] == want
    # an allowed host's URL is fetched: the same answer as the same bytes inline
    fetched = httpx.post(
        f"{serve.url}/v1/chat/completions", json=chat_body(f"{image_server}/cat.png"), timeout=60
    )
    inline = httpx.post(f"{serve.url}/v1/chat/completions", json=chat_body(data_url(png(11))), timeout=60)
    assert fetched.status_code == 200, fetched.text
    assert fetched.json()["choices"][0]["message"] == inline.json()["choices"][0]["message"]


def test_the_same_image_hits_both_caches_and_another_only_the_text(serve: Serve, metrics_port: int) -> None:
    def hits() -> float:
        return scrape(metrics_port + 3)[("deepinfer_encoder_cache_hits_total", ())]

    text = "Describe this picture in detail, please."
    first = httpx.post(f"{serve.url}/v1/chat/completions", json=chat_body(data_url(png(5)), text=text))
    before = hits()
    again = httpx.post(f"{serve.url}/v1/chat/completions", json=chat_body(data_url(png(5)), text=text))
    other = httpx.post(f"{serve.url}/v1/chat/completions", json=chat_body(data_url(png(6)), text=text))
    for resp in (first, again, other):
        assert resp.status_code == 200, resp.text
    assert hits() == before + 1  # the same image again: encoded once
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (again, other)]
    # the same image: every full block but the last token's; another: the blocks before the image
    # (its 16 tokens start at position 27: block 0 only, blocks 1-2 hold image tokens)
    assert cached[0] == (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert cached[1] == BLOCK_SIZE
    assert first.json()["choices"][0]["message"] == again.json()["choices"][0]["message"]


BAD_IMAGES = {
    "truncated": data_url(png(7)[:300]),
    "not_an_image": data_url(b"GIF89a but not really an image at all"),
    "huge": data_url(png(8, size=(2048, 1024))),  # over --max-image-pixels (2**20)
    "bad_base64": "data:image/png;base64,@@@@",
    "wrong_type": data_url(png(7), "image/tiff"),
    "disallowed_url": "http://example.com/cat.png",
}


def _openai_error(resp: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    return error


def test_bad_images_are_400s_in_each_api_while_a_stream_goes_on(serve: Serve) -> None:
    long = chat_body(data_url(png(9)), stream=True, max_tokens=40, ignore_eos=True)
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", f"{serve.url}/v1/chat/completions", json=long) as stream,
    ):
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it has started
        for name, url in BAD_IMAGES.items():
            resp = httpx.post(f"{serve.url}/v1/chat/completions", json=chat_body(url), timeout=60)
            assert resp.status_code == 400, (name, resp.text)
            assert _openai_error(resp)["param"].startswith("messages[0].content[0]"), name
            responses = {"model": NAME, "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": url}]}]}  # fmt: skip
            resp = httpx.post(f"{serve.url}/v1/responses", json=responses, timeout=60)
            assert resp.status_code == 400, (name, resp.text)
            _openai_error(resp)
        for name, data in (("truncated", png(7)[:300]), ("huge", png(8, size=(2048, 1024)))):
            block = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()}
            messages = {"model": NAME, "max_tokens": 4, "messages": [
                {"role": "user", "content": [{"type": "image", "source": block}]}]}  # fmt: skip
            resp = httpx.post(f"{serve.url}/v1/messages", json=messages, timeout=60)
            assert resp.status_code == 400, (name, resp.text)
            assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "invalid_request_error"
        # a stored response keeps its input whole: one too large to store is refused up front
        big = data_url(png(10, size=(1500, 1400)))  # noise: ~6.3 MB of PNG, ~8.4 MB of base64
        responses = {"model": NAME, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": big}]}]}  # fmt: skip
        resp = httpx.post(f"{serve.url}/v1/responses", json=responses, timeout=60)
        assert resp.status_code == 400 and _openai_error(resp)["param"] == "store", resp.text
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert sum('"content":' in line for line in rest) >= 39  # every token of the stream arrived


def test_a_killed_encoder_comes_back(serve: Serve) -> None:
    (encoder,) = serve.children(" encoder")
    encoder.kill()  # SIGKILL: serve restarts it; meanwhile an image request is a 503, never a hang
    serve.wait_until("the encoder back", lambda: encodes(serve), 120)
    assert serve.children(" encoder")[0].pid != encoder.pid


def test_a_request_held_by_a_killed_encoder_is_answered_by_its_replacement(serve: Serve) -> None:
    (encoder,) = serve.children(" encoder")
    encoder.suspend()  # SIGSTOP: the next request is delivered to it, and it sits on it
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        body = chat_body(data_url(png(12)))
        future = pool.submit(httpx.post, f"{serve.url}/v1/chat/completions", json=body, timeout=120)
        time.sleep(1.0)
        encoder.kill()
        resp = future.result()
    assert resp.status_code == 200, resp.text
    # the gateway saw that encoder die and asked again: not the 60 s the request would wait out
    assert time.monotonic() - started < 40
