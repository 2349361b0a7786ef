"""The HTTP layer in-process (starlette TestClient) over the in-memory bus: admission errors, and
n choices with logprobs and stop strings against a fake scheduler that runs each choice."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from libs.bus.base import Message
from libs.bus.memory import InMemoryBus
from libs.protocol.codec import decode, encode, pack_floats, pack_tokens
from libs.protocol.messages import (
    CancelRequest,
    FinishReason,
    Logprobs,
    RequestOutput,
    StepOutputs,
    SubmitReply,
    SubmitRequest,
    SubmitStatus,
    seq_id_of,
)
from libs.protocol.subjects import Subjects
from services.gateway.app import build_app
from services.gateway.response_store import ResponseStore
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService

SUBJECTS = Subjects()
BODY = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# What choice i generates (then EOS). Only choice 1 contains the stop string used below.
TEXTS = ["Alpha beta gamma.", "Delta STOP epsilon zeta.", "Eta theta iota kappa."]
NUM_TOP_SENT = 3  # the fake worker sends more alternatives than asked: the gateway trims


class FakeScheduler:
    """Admits every submit and runs it: choice i generates TEXTS[i] + EOS, two tokens per step,
    choices interleaved in one StepOutputs per step; a cancel stops a choice or the whole request."""

    def __init__(self, bus: InMemoryBus, served: ServedModel) -> None:
        self.bus = bus
        self.tokenizer = served.tokenizer
        self.eos = served.eos_token_id
        self.submitted: list[SubmitRequest] = []
        self.cancelled: list[str] = []
        self.cached = 0  # prompt tokens each request reports as served from the prefix cache
        self.seq = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.bus.subscribe(SUBJECTS.submit, self.on_submit)
        await self.bus.subscribe(SUBJECTS.cancel, self.on_cancel)

    def choice_ids(self, index: int) -> list[int]:
        return [*self.tokenizer.encode(TEXTS[index]), self.eos]

    async def on_submit(self, msg: Message) -> None:
        req = decode(SubmitRequest, msg.data)
        self.submitted.append(req)
        await self.bus.respond(msg, encode(SubmitReply(SubmitStatus.ACCEPTED, scheduler_id="s1")))
        task = asyncio.create_task(self.run(req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def on_cancel(self, msg: Message) -> None:
        self.cancelled += decode(CancelRequest, msg.data).request_ids

    def _running(self, request_id: str, index: int) -> bool:
        return request_id not in self.cancelled and seq_id_of(request_id, index) not in self.cancelled

    async def run(self, req: SubmitRequest) -> None:
        n, num_prompt = req.sampling_params.n, len(req.prompt_token_ids) // 4
        ids = [self.choice_ids(i) for i in range(n)]
        for step in range(0, max(len(x) for x in ids), 2):
            outputs = []
            for i in range(n):
                new = ids[i][step : step + 2]
                if new and self._running(req.request_id, i):
                    total = step + len(new)
                    finish = FinishReason.STOP if total == len(ids[i]) else None
                    lp = self.logprobs(new) if req.sampling_params.logprobs else None
                    outputs.append(
                        RequestOutput(
                            req.request_id,
                            pack_tokens(new),
                            total,
                            num_prompt,
                            finish,
                            num_cached_tokens=min(self.cached, num_prompt),
                            index=i,
                            logprobs=lp,
                        )
                    )
            self.seq += 1
            await self.bus.publish_durable(
                SUBJECTS.out("gw1"), encode(StepOutputs("s1", self.seq, tuple(outputs)))
            )
            await asyncio.sleep(0.005)  # let cancels in

    def logprobs(self, token_ids: list[int]) -> Logprobs:
        # Alternatives: the token itself, then EOS, then token 0.
        top = [pair for t in token_ids for pair in ((t, -0.5), (self.eos, -1.0), (0, -2.0))]
        return Logprobs(
            pack_floats([-0.5] * len(token_ids)),
            pack_tokens([t for t, _ in top]),
            pack_floats([lp for _, lp in top]),
            NUM_TOP_SENT,
        )


@pytest.fixture(scope="module")
def served(model_cache_dir: Path) -> ServedModel:
    return ServedModel.load("smollm2", str(model_cache_dir), "", 0)


Make = Callable[..., tuple[TestClient, FakeScheduler]]


@pytest.fixture
def client_with(served: ServedModel) -> Iterator[Make]:
    """make(status, retry_after_s): status None = no scheduler, "run" = the FakeScheduler."""

    def make(status: SubmitStatus | str | None, retry_after_s: int = 1) -> tuple[TestClient, FakeScheduler]:
        bus = InMemoryBus()
        service = GatewayService(bus, SUBJECTS, "gw1", submit_timeout_s=1)
        fake = FakeScheduler(bus, served)

        async def on_submit(msg: Message) -> None:
            assert isinstance(status, SubmitStatus)
            await bus.respond(msg, encode(SubmitReply(status, "nope")))

        async def startup() -> None:
            await service.start()
            await store.start()
            if status == "run":
                await fake.start()
            elif status is not None:
                await bus.subscribe(SUBJECTS.submit, on_submit)

        store = ResponseStore(bus, SUBJECTS.responses_bucket, 60)
        client = TestClient(build_app(service, served, store, retry_after_s))
        client.__enter__()  # the portal's event loop now runs until __exit__
        assert client.portal is not None
        client.portal.call(startup)
        clients.append(client)
        return client, fake

    clients: list[TestClient] = []
    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.mark.parametrize(
    ("status", "http_status"),
    [
        (SubmitStatus.QUEUE_FULL, 429),
        (None, 503),
        (SubmitStatus.NO_WORKERS, 503),
        (SubmitStatus.INVALID, 400),
    ],
)
def test_admission_errors_map_to_http(
    client_with: Make, status: SubmitStatus | None, http_status: int
) -> None:
    client, _ = client_with(status)
    resp = client.post("/v1/chat/completions", json=BODY)
    assert resp.status_code == http_status
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    if http_status == 429:
        assert resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["code"] == "queue_full"
    else:
        assert "retry-after" not in resp.headers
    assert client.get("/health").status_code == 503  # no live worker or scheduler members


def test_retry_after_is_configured(client_with: Make) -> None:
    client, _ = client_with(SubmitStatus.QUEUE_FULL, retry_after_s=7)
    resp = client.post("/v1/chat/completions", json=BODY)
    assert resp.status_code == 429 and resp.headers["retry-after"] == "7"


N_BODY: dict[str, Any] = {
    **BODY,
    "max_tokens": 40,
    "n": 3,
    "stop": ["STOP"],
    "logprobs": True,
    "top_logprobs": 2,
    "temperature": 0.5,
    "top_k": -1,
    "min_p": 0.1,
    "seed": 7,
}


def tokens_before_stop(fake: FakeScheduler, index: int, stop: str) -> int:
    """How many of choice ``index``'s tokens begin before ``stop`` in its text."""
    cut, offset, count = TEXTS[index].index(stop), 0, 0
    for token_id in fake.choice_ids(index):
        if offset >= cut:
            break
        offset += len(fake.tokenizer.token_bytes(token_id).decode())
        count += 1
    return count


def test_n_choices_with_logprobs_and_a_stop_string(client_with: Make) -> None:
    client, fake = client_with("run")
    resp = client.post("/v1/chat/completions", json=N_BODY)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    [submitted] = fake.submitted  # one submit carries every choice
    params = submitted.sampling_params
    assert (params.n, params.logprobs, params.top_logprobs, params.max_tokens) == (3, True, 2, 40)
    assert (params.temperature, params.top_k, params.min_p, params.seed) == (0.5, 0, 0.1, 7)
    assert fake.cancelled == [seq_id_of(body["id"], 1)]  # the stop string ended choice 1 only
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["message"]["content"] for c in choices] == [TEXTS[0], "Delta ", TEXTS[2]]
    assert [c["finish_reason"] for c in choices] == ["stop"] * 3
    for i in (0, 2):
        content = choices[i]["logprobs"]["content"]
        assert b"".join(bytes(e["bytes"]) for e in content) == TEXTS[i].encode() + b"<|im_end|>"
        assert [e["token"] for e in content] == [
            fake.tokenizer.token_bytes(t).decode() for t in fake.choice_ids(i)
        ]
        assert all(e["logprob"] == -0.5 and len(e["top_logprobs"]) == 2 for e in content)
        assert [t["token"] for t in content[0]["top_logprobs"]] == [content[0]["token"], "<|im_end|>"]
    stopped = choices[1]["logprobs"]["content"]
    assert len(stopped) == tokens_before_stop(fake, 1, "STOP")
    assert "".join(e["token"] for e in stopped).startswith("Delta ")
    usage = body["usage"]
    num_full = len(fake.choice_ids(0)) + len(fake.choice_ids(2))
    assert len(stopped) <= usage["completion_tokens"] - num_full < len(fake.choice_ids(1))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] == len(submitted.prompt_token_ids) // 4


def sse_chunks(text: str) -> list[dict[str, Any]]:
    lines = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_streamed_choices_each_chunk_one_choice_and_same_as_non_stream(client_with: Make) -> None:
    client, _ = client_with("run")
    whole = client.post("/v1/chat/completions", json=N_BODY).json()
    body = {**N_BODY, "stream": True, "stream_options": {"include_usage": True}}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(resp.text)
    assert len({c["id"] for c in chunks}) == 1
    *deltas, last = chunks
    assert last["choices"] == [] and last["usage"] == whole["usage"]  # usage once, at the end
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in deltas)
    assert [c["choices"][0]["delta"] for c in deltas[:3]] == [{"role": "assistant", "content": ""}] * 3
    texts, entries, finishes = ["", "", ""], [[], [], []], [[], [], []]  # type: ignore[var-annotated]
    for chunk in deltas[3:]:
        [choice] = chunk["choices"]
        i, piece = choice["index"], choice["delta"].get("content", "")
        if choice["finish_reason"] is not None:
            # Entries of text held back as a possible stop string, and of EOS, ride on the finish.
            assert choice["delta"] == {}
            entries[i] += choice["logprobs"]["content"]
            finishes[i].append(choice["finish_reason"])
            continue
        texts[i] += piece
        entries[i] += choice["logprobs"]["content"]
        if i != 1:  # no stop string here: a chunk's entries spell exactly its text (EOS aside)
            spelled = b"".join(bytes(e["bytes"]) for e in choice["logprobs"]["content"])
            assert spelled.removesuffix(b"<|im_end|>") == piece.encode()
    assert finishes == [["stop"]] * 3
    assert texts == [c["message"]["content"] for c in whole["choices"]]
    assert entries == [c["logprobs"]["content"] for c in whole["choices"]]
    assert len({c["choices"][0]["index"] for c in deltas[3:9]}) > 1  # choices interleave


def test_one_choice_without_logprobs_keeps_the_plain_shape(client_with: Make) -> None:
    client, fake = client_with("run")
    body = client.post("/v1/chat/completions", json={**BODY, "max_tokens": 40}).json()
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": TEXTS[0]},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"]["completion_tokens"] == len(fake.choice_ids(0)) and fake.cancelled == []
    chunks = sse_chunks(
        client.post("/v1/chat/completions", json={**BODY, "max_tokens": 40, "stream": True}).text
    )
    assert all("usage" not in c and c["choices"][0]["logprobs"] is None for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == TEXTS[0]


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"n": 17}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"min_tokens": 41, "max_tokens": 40}, "min_tokens"),
    ],
)
def test_bad_sampling_fields_get_400_and_the_service_goes_on(
    client_with: Make, patch: dict[str, Any], param: str
) -> None:
    client, fake = client_with("run")
    resp = client.post("/v1/chat/completions", json={**BODY, **patch})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param
    assert fake.submitted == []
    assert client.post("/v1/chat/completions", json=BODY).status_code == 200


MODEL = BODY["model"]
LONG = "word " * 9000  # past SmolLM2's 8192-token context


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/chat/completions", {**BODY, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        ("/v1/chat/completions", {**BODY, "messages": [{"role": "tool", "content": "x"}]}, 400, "tool"),
        (
            "/v1/chat/completions",
            {**BODY, "tools": [{"type": "function", "function": {"name": "a b"}}]},
            400,
            "",
        ),
        ("/v1/chat/completions", {**BODY, "frobnicate": 1}, 400, "frobnicate"),
        ("/v1/chat/completions", {**BODY, "messages": [{"role": "user", "content": LONG}]}, 400, "context"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
        # token ids past SmolLM2's 49152 (they would fail the worker's step)
        ("/v1/completions", {"model": MODEL, "prompt": [49152]}, 400, "token id 49152"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 49152], "echo": True}, 400, "token id 49152"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [49152]}, 400, "49152"),
        ("/v1/chat/completions", {**BODY, "stop_token_ids": [2, 10**6]}, 400, "token id 1000000"),
        (
            "/v1/responses",
            {"model": MODEL, "input": "x", "previous_response_id": "resp_nope"},
            400,
            "resp_nope",
        ),
        (
            "/v1/responses",
            {"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c"}]},
            400,
            "",
        ),
        ("/v1/responses", {"model": "other", "input": "x"}, 404, "other"),
        ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),
        (
            "/v1/messages",
            {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": LONG}]},
            400,
            "",
        ),
        ("/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": [], "x": 1}, 400, ""),
        ("/v1/messages/count_tokens", {"model": MODEL, "messages": "nope"}, 400, "messages"),
    ],
)
def test_bad_input_gets_the_apis_error_shape_and_loses_nothing(
    client_with: Make, path: str, body: dict[str, Any], status: int, fragment: str
) -> None:
    client, fake = client_with("run")
    resp = client.post(path, json=body)
    assert resp.status_code == status
    if path.startswith("/v1/messages"):
        error = resp.json()
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
        message = error["error"]["message"]
    else:
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        message = resp.json()["error"]["message"]
    assert fragment in message
    assert fake.submitted == []
    assert client.post("/v1/chat/completions", json=BODY).status_code == 200  # still serving


def test_a_body_over_the_limit_is_a_413(client_with: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("services.gateway.serving.MAX_BODY_BYTES", 1000)
    client, fake = client_with("run")
    resp = client.post("/v1/chat/completions", json={**BODY, "messages": [{"role": "user", "content": LONG}]})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert fake.submitted == []
