"""The gateway moves a request a scheduler handed back (its worker died with no other to take it)
and a resumed stream's request when its scheduler dies (in-memory bus, scripted schedulers): the
request goes on at another replica from the tokens received, with its move and crash counts;
exactly one gateway moves a request (the last to submit or resume it), and a reader whose mover
never moves it ends with an error within a bound instead of hanging; a scheduler restarted under
its id counts as lost (another process)."""

from __future__ import annotations

import asyncio
import dataclasses

from libs.bus.memory import InMemoryBus
from libs.protocol.codec import encode, pack_tokens, unpack_tokens
from libs.protocol.member_messages import MemberInfo, MemberKind
from libs.protocol.messages import (
    FinishReason,
    Handback,
    RequestOutput,
    SamplingParams,
    SchedulerRef,
    SubmitRequest,
    SubmitStatus,
)
from libs.protocol.stream_messages import ResumeClaim
from tests.service.test_gateway_migration import Scene, make_gateway
from tests.service.test_gateway_migration import scene as scene  # the fixture, shared
from tests.service.test_gateway_service import SUBJECTS, ScriptedScheduler, record_for
from tests.service.test_liveness import heartbeat, rest, until

PARAMS = SamplingParams(max_tokens=8)
LOST = "worker w1 lost: its step failed"


def out(tokens: list[int], total: int, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput("r1", pack_tokens(tokens), total, 3, finish)


def handed_back(tokens: list[int], total: int, num_moves: int = 0, num_crashes: int = 1) -> RequestOutput:
    return RequestOutput(
        "r1",
        pack_tokens(tokens),
        total,
        3,
        FinishReason.ERROR,
        error=LOST,
        handback=Handback(num_moves, num_crashes),
    )


async def test_a_handed_back_request_goes_on_at_another_replica(scene: Scene) -> None:
    service, first = scene.service, scene.first
    stream = await service.submit("r1", [1, 2, 3], PARAMS, eos_token_id=0)
    await first.emit(out([5], 1))
    second = await scene.join(ScriptedScheduler(scene.bus, scheduler_id="s2"))
    await first.emit(handed_back([6], 2, num_moves=1))  # moved once within s1 already
    await until(lambda: bool(second.submitted))
    (req,) = second.submitted
    assert [unpack_tokens(t) for t in req.output_token_ids] == [[5, 6]]
    assert (req.num_moves, req.num_crashes, req.gateway_id) == (2, 1, "gw1")
    await second.emit(out([7], 3, FinishReason.LENGTH))
    deltas = await rest(stream)
    assert [(d.token_ids, d.finish_reason, d.error) for d in deltas] == [
        ([5], None, ""),
        ([6], None, ""),
        ([7], FinishReason.LENGTH, ""),
    ]
    assert len(first.submitted) == 1  # the replica that handed it back is tried last
    assert service.migrations.num_moves == {"moved": 1, "failed": 0}


async def test_with_no_other_replica_a_hand_back_waits_for_its_own_to_take_it_again(scene: Scene) -> None:
    """One replica: its worker died, and it takes the request again once it drives a worker
    (a restarted worker rejoins it) within the resubmit window."""
    service, first = scene.service, scene.first
    stream = await service.submit("r1", [1, 2, 3], PARAMS, eos_token_id=0)
    await first.emit(out([5], 1))
    first.status = SubmitStatus.NO_WORKERS
    await first.emit(handed_back([], 1))
    await until(lambda: len(first.submitted) >= 3)  # refused while it has no worker
    first.status = SubmitStatus.ACCEPTED
    await until(lambda: service.migrations.num_moves["moved"] == 1)
    await first.emit(out([6], 2, FinishReason.LENGTH))
    deltas = await rest(stream)
    assert [(d.token_ids, d.error) for d in deltas] == [([5], ""), ([6], "")]


async def test_a_hand_back_past_the_migration_limit_ends_the_stream_naming_the_worker(scene: Scene) -> None:
    stream = await scene.service.submit("r1", [1, 2, 3], PARAMS, eos_token_id=0)
    await scene.first.emit(handed_back([5], 1, num_moves=3))
    deltas = await rest(stream)
    assert [(d.token_ids, d.error) for d in deltas] == [
        ([5], ""),
        ([], f"{LOST}; the migration limit (3 moves) is reached"),
    ]


async def test_a_resumed_stream_moves_when_its_scheduler_dies(scene: Scene) -> None:
    """gw1 (which submitted it) is gone; gw2 resumes the stream from its record and, when s1 dies,
    resubmits the request with the record's submit: its outputs still go to gw1's subject."""
    bus = scene.bus
    record = dataclasses.replace(
        record_for(scene.service, "r1", 1),
        submit=SubmitRequest("r1", "gw1", pack_tokens([1, 2, 3]), PARAMS, 0),
        schedulers=(SchedulerRef("s1"),),
    )
    await scene.first.emit(out([5], 1))  # what the client had seen before it reconnected
    resumer = make_gateway(bus, "gw2")
    await resumer.start()
    try:
        replay = await resumer.replay(record)
        assert resumer.num_in_flight == 1
        await scene.kill_first()
        second = await scene.join(ScriptedScheduler(bus, scheduler_id="s2"), resumer)
        await until(lambda: bool(second.submitted), timeout_s=15)
        (req,) = second.submitted
        assert (req.gateway_id, req.num_moves) == ("gw1", 1)
        assert [unpack_tokens(t) for t in req.output_token_ids] == [[5]]
        await second.emit(out([6], 2, FinishReason.LENGTH))
        deltas = await rest(replay)
        assert [(d.token_ids, d.error) for d in deltas] == [([5], ""), ([6], "")]
        # (the record is written once s2's reply is in, which may come after the stream's end)
        want = (SchedulerRef("s1"), SchedulerRef("s2"))
        async with asyncio.timeout(5):
            while (stored := await resumer.stream_record("r1")) is None or stored.schedulers != want:
                await asyncio.sleep(0.02)
    finally:
        await resumer.close()


async def test_after_a_resume_elsewhere_only_the_resumer_moves_the_request(scene: Scene) -> None:
    """A background stream read at gw1 and resumed at gw2: when s1 dies, one resubmit (gw2's);
    both readers go on with the new replica's outputs."""
    service, bus = scene.service, scene.bus
    record = dataclasses.replace(record_for(service, "r1", service.next_out_seq()), background=True)
    live = await service.submit("r1", [1, 2, 3], PARAMS, 0, record)
    await scene.first.emit(out([5], 1))
    stored = await service.stream_record("r1")
    assert stored is not None
    resumer = make_gateway(bus, "gw2")
    await resumer.start()
    try:
        replay = await resumer.replay(stored, on_leave="never")
        await until(lambda: "r1" not in service.migrations.movers)  # gw1 heard the claim
        await scene.kill_first()
        second = await scene.join(ScriptedScheduler(bus, scheduler_id="s2"), resumer)
        await until(lambda: bool(second.submitted), timeout_s=15)
        await second.emit(out([6], 2, FinishReason.LENGTH))
        for stream in (live, replay):
            deltas = await rest(stream)
            assert [(d.token_ids, d.error) for d in deltas] == [([5], ""), ([6], "")]
        assert len(second.submitted) == 1
        assert service.migrations.num_moves["moved"] == 0 and resumer.migrations.num_moves["moved"] == 1
    finally:
        await resumer.close()


async def test_a_reader_whose_mover_never_moves_it_ends_with_an_error(scene: Scene) -> None:
    """Another gateway claimed the request (then died): gw1 leaves the move to it, and when s1 dies
    and nothing moves the request, gw1's reader ends with an error within a bound."""
    service = scene.service
    stream = await service.submit("r1", [1, 2, 3], PARAMS, eos_token_id=0)
    await scene.first.emit(out([5], 1))
    await scene.bus.publish(SUBJECTS.resume_claim, encode(ResumeClaim("r1", "gw9")))
    await until(lambda: "r1" not in service.migrations.movers)
    await scene.kill_first()
    deltas = await rest(stream, timeout_s=20)
    assert [(d.token_ids, d.error) for d in deltas] == [
        ([5], ""),
        ([], "scheduler s1 left it, not moved in 6 s"),
    ]


async def test_a_scheduler_restarted_under_its_id_is_another_process() -> None:
    """kill -9 of s1 and an immediate restart under the same id (a supervisor that keeps the id):
    the new process holds nothing of the old one's, so the request moves (to it), and what still
    comes from the old one is dropped."""
    bus = InMemoryBus()
    service = make_gateway(bus, "gw1")
    await service.start()
    incarnation = "a"
    beats = [
        await heartbeat(bus, lambda: MemberInfo(MemberKind.SCHEDULER, "s1", incarnation=incarnation)),
        await heartbeat(bus, lambda: MemberInfo(MemberKind.WORKER, "w1", owner="s1")),
    ]
    old = ScriptedScheduler(bus, incarnation="a")
    await old.start()
    try:
        await until(service.ready)
        stream = await service.submit("r1", [1, 2, 3], PARAMS, eos_token_id=0)
        await old.emit(out([5], 1))
        await old.stop()
        new = ScriptedScheduler(bus, incarnation="b")
        await new.start()
        incarnation = "b"
        await until(lambda: bool(new.submitted), timeout_s=15)
        (req,) = new.submitted
        assert req.num_moves == 1 and [unpack_tokens(t) for t in req.output_token_ids] == [[5]]
        await old.emit(out([66], 2))  # the old process's last, late: dropped
        await new.emit(out([6], 2, FinishReason.LENGTH))
        deltas = await rest(stream)
        assert [(d.token_ids, d.error) for d in deltas] == [([5], ""), ([6], "")]
    finally:
        for beat in beats:
            beat.cancel()
        await service.close()
        await bus.close()


async def test_a_replay_tells_an_old_hand_back_from_a_new_one_at_the_same_scheduler(scene: Scene) -> None:
    """The record says s1 took the request twice (it handed it back once, then took it again
    after a move): the first hand-back, in the replayed history, moves nothing; the second moves
    the request to s2."""
    bus = scene.bus
    record = dataclasses.replace(
        record_for(scene.service, "r1", 1),
        submit=SubmitRequest("r1", "gw1", pack_tokens([1, 2, 3]), PARAMS, 0),
        schedulers=(SchedulerRef("s1"), SchedulerRef("s1")),
        num_moves=1,
    )
    await scene.first.emit(out([5], 1))
    await scene.first.emit(handed_back([], 1, num_moves=0))  # old news: dealt with before
    await scene.first.emit(out([6], 2))
    resumer = make_gateway(bus, "gw2")
    await resumer.start()
    try:
        second = await scene.join(ScriptedScheduler(bus, scheduler_id="s2"), resumer)
        replay = await resumer.replay(record)
        await until(lambda: resumer.num_in_flight == 1 and len(replay._pending.received[0]) == 2)
        assert second.submitted == [] and scene.first.submitted == []
        await scene.first.emit(handed_back([7], 3, num_moves=1))
        await until(lambda: bool(second.submitted))
        (req,) = second.submitted
        assert req.num_moves == 2 and [unpack_tokens(t) for t in req.output_token_ids] == [[5, 6, 7]]
        await second.emit(out([8], 4, FinishReason.LENGTH))
        deltas = await rest(replay)
        assert [(d.token_ids, d.error) for d in deltas] == [([5], ""), ([6], ""), ([7], ""), ([8], "")]
    finally:
        await resumer.close()
