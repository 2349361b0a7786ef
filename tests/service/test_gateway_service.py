"""The gateway's bus side on the in-memory bus, with a scripted scheduler: demux of requests and their
choices, loss detection per choice, logprobs checks, cancel of a request or of one choice."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator

import pytest

from libs.bus.base import Message
from libs.bus.memory import InMemoryBus
from libs.protocol.codec import decode, encode, pack_floats, pack_tokens
from libs.protocol.kv_messages import KVCacheStats, TierCounter
from libs.protocol.messages import (
    CancelRequest,
    FinishReason,
    Logprobs,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    SubmitReply,
    SubmitRequest,
    SubmitStatus,
    seq_id_of,
)
from libs.protocol.stream_messages import StreamRecord
from libs.protocol.subjects import Subjects
from services.gateway.logprobs import TokenLogprob
from services.gateway.request_stream import Delta
from services.gateway.service import GatewayService, SubmitRejected

SUBJECTS = Subjects()
PARAMS = SamplingParams(temperature=0.0, max_tokens=8)


class ScriptedScheduler:
    def __init__(
        self,
        bus: InMemoryBus,
        status: SubmitStatus = SubmitStatus.ACCEPTED,
        scheduler_id: str = "s1",
        incarnation: str = "",
    ) -> None:
        self.bus = bus
        self.status = status
        self.scheduler_id = scheduler_id
        self.incarnation = incarnation
        self.submitted: list[SubmitRequest] = []
        self.cancelled: list[str] = []
        self.seq = 0

    async def start(self) -> None:
        self.subscriptions = [
            await self.bus.subscribe(SUBJECTS.submit, self.on_submit, queue="schedulers"),
            await self.bus.subscribe(SUBJECTS.submit_to(self.scheduler_id), self.on_submit),
            await self.bus.subscribe(SUBJECTS.cancel, self.on_cancel),
        ]

    async def stop(self) -> None:
        """Gone from the bus (its process killed): it answers nothing more."""
        for sub in self.subscriptions:
            await sub.unsubscribe()

    async def on_submit(self, msg: Message) -> None:
        self.submitted.append(decode(SubmitRequest, msg.data))
        reply = SubmitReply(self.status, "busy", self.scheduler_id, self.seq, self.incarnation)
        await self.bus.respond(msg, encode(reply))

    async def on_cancel(self, msg: Message) -> None:
        self.cancelled += decode(CancelRequest, msg.data).request_ids

    async def emit(self, *outputs: RequestOutput, seq: int | None = None) -> None:
        self.seq = self.seq + 1 if seq is None else seq
        step = StepOutputs(self.scheduler_id, self.seq, outputs, self.incarnation)
        await self.bus.publish_durable(SUBJECTS.out("gw1"), encode(step))


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[GatewayService, ScriptedScheduler]]:
    bus = InMemoryBus()
    service = GatewayService(bus, SUBJECTS, "gw1", submit_timeout_s=1)
    await service.start()
    scheduler = ScriptedScheduler(bus)
    await scheduler.start()
    yield service, scheduler
    await bus.close()


def out(
    request_id: str,
    tokens: list[int],
    total: int,
    finish: FinishReason | None = None,
    index: int = 0,
    logprobs: Logprobs | None = None,
) -> RequestOutput:
    return RequestOutput(request_id, pack_tokens(tokens), total, 3, finish, index=index, logprobs=logprobs)


async def drain(stream: AsyncIterable[Delta]) -> list[Delta]:
    return [d async for d in stream]


async def test_outputs_of_two_requests_are_demuxed(gateway) -> None:  # type: ignore[no-untyped-def]
    service, scheduler = gateway
    a = await service.submit("a", [1, 2, 3], PARAMS, 2)
    b = await service.submit("b", [4, 5, 6], PARAMS, 2)
    await scheduler.emit(out("a", [10], 1), out("b", [20], 1))
    await scheduler.emit(out("b", [21], 2, FinishReason.STOP), out("a", [11], 2))
    await scheduler.emit(out("a", [12], 3, FinishReason.LENGTH))
    deltas_a, deltas_b = await asyncio.wait_for(asyncio.gather(drain(a), drain(b)), 2)
    assert [t for d in deltas_a for t in d.token_ids] == [10, 11, 12]
    assert [t for d in deltas_b for t in d.token_ids] == [20, 21]
    assert (
        deltas_a[-1].finish_reason is FinishReason.LENGTH and deltas_b[-1].finish_reason is FinishReason.STOP
    )
    assert service.num_in_flight == 2  # until each stream is closed
    a.close()
    b.close()
    assert service.num_in_flight == 0 and scheduler.cancelled == []


async def test_a_gap_in_step_sequence_fails_the_request_loudly(gateway) -> None:  # type: ignore[no-untyped-def]
    service, scheduler = gateway
    a = await service.submit("a", [1], PARAMS, 2)
    await scheduler.emit(out("a", [10], 1))
    await scheduler.emit(out("a", [12], 3), seq=3)  # message 2 was lost
    deltas = await asyncio.wait_for(drain(a), 2)
    assert deltas[-1].finish_reason is FinishReason.ERROR and "lost" in deltas[-1].error


async def test_lost_tokens_are_detected_per_request(gateway) -> None:  # type: ignore[no-untyped-def]
    service, scheduler = gateway
    a = await service.submit("a", [1], PARAMS, 2)
    await scheduler.emit(out("a", [10], 2))  # claims two tokens, carries one
    deltas = await asyncio.wait_for(drain(a), 2)
    assert deltas[-1].finish_reason is FinishReason.ERROR and "lost tokens" in deltas[-1].error


async def test_closing_early_cancels(gateway) -> None:  # type: ignore[no-untyped-def]
    service, scheduler = gateway
    a = await service.submit("a", [1], PARAMS, 2)
    await scheduler.emit(out("a", [10], 1))
    async for _ in a:
        break
    a.close()
    a.close()  # idempotent
    await asyncio.sleep(0.01)
    assert scheduler.cancelled == ["a"]
    assert service.num_in_flight == 0


async def test_rejections() -> None:
    bus = InMemoryBus()
    service = GatewayService(bus, SUBJECTS, "gw1", submit_timeout_s=1)
    await service.start()
    with pytest.raises(SubmitRejected) as info:  # no scheduler at all
        await service.submit("a", [1], PARAMS, 2)
    assert info.value.status is SubmitStatus.NO_WORKERS
    scheduler = ScriptedScheduler(bus, SubmitStatus.QUEUE_FULL)
    await scheduler.start()
    with pytest.raises(SubmitRejected) as info:
        await service.submit("b", [1], PARAMS, 2)
    assert info.value.status is SubmitStatus.QUEUE_FULL
    assert service.num_in_flight == 0
    await bus.close()


async def test_a_submit_nobody_answers_in_time_is_a_503_and_cancelled() -> None:
    """A scheduler killed a moment ago may still be subscribed: the submit times out. The client
    gets a 503 saying so (not a 500), and a cancel goes out, in case it was taken after all."""
    bus = InMemoryBus()
    service = GatewayService(bus, SUBJECTS, "gw1", submit_timeout_s=0.2)
    await service.start()
    scheduler = ScriptedScheduler(bus)
    await scheduler.start()

    async def silent(msg: Message) -> None:
        scheduler.submitted.append(decode(SubmitRequest, msg.data))

    scheduler.on_submit = silent  # type: ignore[method-assign]
    await scheduler.stop()
    await scheduler.start()  # subscribed again, with the silent handler
    with pytest.raises(SubmitRejected) as info:
        await service.submit("a", [1], PARAMS, 2)
    assert info.value.status is SubmitStatus.NO_WORKERS
    assert str(info.value) == "the scheduler did not answer within 0.2 s"
    await asyncio.sleep(0.01)
    assert [r.request_id for r in scheduler.submitted] == ["a"] and scheduler.cancelled == ["a"]
    assert service.num_in_flight == 0
    await bus.close()


async def test_the_submit_carries_the_tenant_and_the_retention_class(gateway) -> None:  # type: ignore[no-untyped-def]
    service, scheduler = gateway
    (await service.submit("a", [1], PARAMS, 2, tenant="t1", retention_class="chat")).close()
    (await service.submit("b", [1], PARAMS, 2)).close()
    a, b = scheduler.submitted
    assert (a.tenant, a.retention_class) == ("t1", "chat")
    assert (b.tenant, b.retention_class) == ("", "")  # the shared tenant, the store's default class


async def test_every_services_kv_stats_are_kept_per_publisher(gateway) -> None:  # type: ignore[no-untyped-def]
    service, _ = gateway
    first = KVCacheStats("s1", "scheduler", (TierCounter("hit_tokens", "G1", 3),))
    newer = KVCacheStats("s1", "scheduler", (TierCounter("hit_tokens", "G1", 5),))
    worker = KVCacheStats("w1", "worker", (TierCounter("loaded_blocks", "G3", 2),))
    for kind, stats in (("scheduler", first), ("worker", worker), ("scheduler", newer)):
        await service.bus.publish(SUBJECTS.stats(kind, stats.publisher_id), encode(stats))
    await service.bus.publish(SUBJECTS.stats("worker", "w2"), b"not msgpack")  # logged, skipped
    for _ in range(10):  # let the subscription's task take them in
        await asyncio.sleep(0)
    assert service.kv_stats.current(time.monotonic()) == [newer, worker]


def tokens_by_choice(deltas: list[Delta], n: int) -> list[list[int]]:
    by_choice: list[list[int]] = [[] for _ in range(n)]
    for d in deltas:
        by_choice[d.index] += d.token_ids
    return by_choice


def finishes(deltas: list[Delta]) -> dict[int, FinishReason]:
    return {d.index: d.finish_reason for d in deltas if d.finish_reason is not None}


async def test_choices_are_demuxed_and_the_request_ends_with_its_last_choice(gateway) -> None:  # type: ignore[no-untyped-def]
    service, scheduler = gateway
    a = await service.submit("a", [1, 2, 3], SamplingParams(n=3), 2)
    assert scheduler.submitted[0].sampling_params.n == 3  # one submit for all choices
    await scheduler.emit(out("a", [10], 1, index=0), out("a", [20], 1, index=1), out("a", [30], 1, index=2))
    await scheduler.emit(out("a", [21], 2, FinishReason.STOP, index=1), out("a", [11], 2, index=0))
    await scheduler.emit(out("a", [12], 3, FinishReason.LENGTH, index=0))
    await scheduler.emit(out("a", [31, 32], 3, FinishReason.STOP, index=2))
    deltas = await asyncio.wait_for(drain(a), 2)
    assert tokens_by_choice(deltas, 3) == [[10, 11, 12], [20, 21], [30, 31, 32]]
    assert finishes(deltas) == {0: FinishReason.LENGTH, 1: FinishReason.STOP, 2: FinishReason.STOP}
    assert deltas[-1].index == 2  # iteration ran until the last choice ended
    a.close()
    await asyncio.sleep(0.01)
    assert scheduler.cancelled == [] and service.num_in_flight == 0


async def test_lost_tokens_fail_only_their_choice(gateway) -> None:  # type: ignore[no-untyped-def]
    service, scheduler = gateway
    a = await service.submit("a", [1], SamplingParams(n=2), 2)
    await scheduler.emit(out("a", [10], 1, index=0), out("a", [20], 1, index=1))
    await scheduler.emit(out("a", [11], 2, index=0), out("a", [22], 3, index=1))  # choice 1 lost one
    await scheduler.emit(out("a", [12], 3, FinishReason.STOP, index=0))
    deltas = await asyncio.wait_for(drain(a), 2)
    ends = {d.index: d for d in deltas if d.finish_reason is not None}
    assert ends[0].finish_reason is FinishReason.STOP and not ends[0].error
    assert ends[1].finish_reason is FinishReason.ERROR and "lost tokens" in ends[1].error


async def test_stopping_one_choice_cancels_its_sequence_and_drops_its_late_tokens(gateway) -> None:  # type: ignore[no-untyped-def]
    service, scheduler = gateway
    a = await service.submit("a", [1], SamplingParams(n=2), 2)
    await scheduler.emit(out("a", [10], 1, index=0), out("a", [20], 1, index=1))
    seen: list[Delta] = []
    async for delta in a:
        seen.append(delta)
        if delta.index == 1:
            a.stop_choice(1)  # as a stop string in choice 1's text would
            a.stop_choice(1)  # idempotent
            await scheduler.emit(out("a", [21], 2, index=1), out("a", [11], 2, FinishReason.STOP, index=0))
    assert tokens_by_choice(seen, 2) == [[10, 11], [20]]  # 21 was in flight and is dropped
    await asyncio.sleep(0.01)
    assert scheduler.cancelled == [seq_id_of("a", 1)] == ["a#1"]
    a.close()  # every choice is over: nothing more to cancel
    await asyncio.sleep(0.01)
    assert scheduler.cancelled == ["a#1"] and service.num_in_flight == 0


async def test_stopping_a_choice_that_finished_sends_no_cancel(gateway) -> None:  # type: ignore[no-untyped-def]
    service, scheduler = gateway
    a = await service.submit("a", [1], PARAMS, 2)
    await scheduler.emit(out("a", [10], 1, FinishReason.STOP))
    async for delta in a:
        assert delta.finish_reason is FinishReason.STOP
        a.stop_choice(0)  # the stop string arrived with the EOS
    a.close()
    await asyncio.sleep(0.01)
    assert scheduler.cancelled == []


async def test_closing_a_request_with_choices_running_cancels_the_request(gateway) -> None:  # type: ignore[no-untyped-def]
    service, scheduler = gateway
    a = await service.submit("a", [1], SamplingParams(n=2), 2)
    await scheduler.emit(out("a", [10], 1, FinishReason.STOP, index=0))
    async for _ in a:
        break
    a.close()
    await asyncio.sleep(0.01)
    assert scheduler.cancelled == ["a"]  # the request id cancels every choice at once


async def test_a_gap_fails_every_choice_and_a_bad_index_fails_the_request(gateway) -> None:  # type: ignore[no-untyped-def]
    service, scheduler = gateway
    a = await service.submit("a", [1], SamplingParams(n=2), 2)
    b = await service.submit("b", [1], SamplingParams(n=2), 2)
    await scheduler.emit(out("a", [10], 1, FinishReason.STOP, index=0), out("b", [1], 1, index=2))
    await scheduler.emit(out("a", [20], 2, index=1), seq=3)
    deltas_a, deltas_b = await asyncio.wait_for(asyncio.gather(drain(a), drain(b)), 2)
    assert finishes(deltas_a) == {0: FinishReason.STOP, 1: FinishReason.ERROR}
    assert "lost step outputs" in deltas_a[-1].error
    assert finishes(deltas_b) == {0: FinishReason.ERROR, 1: FinishReason.ERROR}
    assert all("choice 2" in d.error for d in deltas_b)


def wire_logprobs(values: list[float], top: list[tuple[int, float]], num_top: int) -> Logprobs:
    return Logprobs(
        pack_floats(values), pack_tokens([t for t, _ in top]), pack_floats([v for _, v in top]), num_top
    )


async def test_logprobs_are_unpacked_per_token_and_checked(gateway) -> None:  # type: ignore[no-untyped-def]
    service, scheduler = gateway
    params = SamplingParams(logprobs=True, top_logprobs=1, n=2)
    a = await service.submit("a", [1], params, 2)
    good = wire_logprobs([-0.5, -0.25], [(10, -0.5), (7, -0.125)], 1)
    await scheduler.emit(out("a", [10, 11], 2, index=0, logprobs=good), out("a", [20], 1, index=1))
    await scheduler.emit(out("a", [], 2, FinishReason.STOP, index=0))  # no tokens: no logprobs needed
    deltas = await asyncio.wait_for(drain(a), 2)
    assert deltas[0].logprobs == (
        TokenLogprob(10, -0.5, ((10, -0.5),)),
        TokenLogprob(11, -0.25, ((7, -0.125),)),
    )
    assert finishes(deltas) == {0: FinishReason.STOP, 1: FinishReason.ERROR}
    assert "bad logprobs" in deltas[1].error  # choice 1 came without them
    b = await service.submit("b", [1], params, 2)
    await scheduler.emit(out("b", [10, 11], 2, index=0, logprobs=wire_logprobs([-0.5], [(10, -0.5)], 1)))
    assert "bad logprobs" in (await asyncio.wait_for(anext(aiter(b)), 2)).error


async def test_logprobs_not_asked_for_are_ignored(gateway) -> None:  # type: ignore[no-untyped-def]
    service, scheduler = gateway
    a = await service.submit("a", [1], PARAMS, 2)
    await scheduler.emit(out("a", [10], 1, FinishReason.STOP, logprobs=wire_logprobs([-1.0, -2.0], [], 0)))
    [delta] = await asyncio.wait_for(drain(a), 2)
    assert (delta.finish_reason, delta.logprobs, delta.token_ids) == (FinishReason.STOP, (), [10])


def record_for(service: GatewayService, request_id: str, start_seq: int) -> StreamRecord:
    return StreamRecord(
        request_id, "chat", service.gateway_id, start_seq, 1, "m", 1, False, 0, False, (), "plain", "content",
        False, False,
    )  # fmt: skip


async def test_a_replay_starts_at_the_requests_first_output_and_follows_it_live(
    gateway: tuple[GatewayService, ScriptedScheduler],
) -> None:
    service, scheduler = gateway
    await scheduler.emit(out("earlier", [9], 1, FinishReason.STOP))  # history the replay must skip
    await asyncio.sleep(0)  # the live consumer sees it
    start = service.next_out_seq()
    assert start == 2
    live = await service.submit("r1", [1, 2, 3], PARAMS, 0, record_for(service, "r1", start))
    stored = await service.stream_record("r1")
    assert stored is not None and stored.start_seq == start
    await scheduler.emit(out("r1", [5, 6], 2))
    replay = await service.replay(stored)
    replayed = aiter(replay)
    assert (await anext(replayed)).token_ids == [5, 6]  # from the stream
    await scheduler.emit(out("other", [7], 1), out("r1", [8], 3, FinishReason.STOP))
    assert [d.token_ids for d in await drain(replay_rest(replayed))] == [[8]]  # then live
    assert [d.token_ids for d in await drain(live)] == [[5, 6], [8]]
    replay.close()
    live.close()


async def replay_rest(it: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    async for delta in it:
        yield delta
