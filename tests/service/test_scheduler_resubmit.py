"""A request resubmitted after its scheduler was lost (the gateway moves it): the scheduler goes on
from the output tokens its client has, per choice, without sending them again; a retried resubmit
is taken once; a resubmit that does not add up, or a new request reusing a live id, is a 400."""

from __future__ import annotations

import asyncio

from libs.bus.memory import InMemoryBus
from libs.protocol.codec import decode, encode, pack_tokens, unpack_tokens
from libs.protocol.messages import (
    FinishReason,
    SamplingParams,
    StepOutputs,
    SubmitReply,
    SubmitRequest,
    SubmitStatus,
)
from services.scheduler.config import Config
from tests.service.scheduler_harness import PROMPT, SUBJECTS, running, submit
from tests.unit.scheduler.fake_worker import EOS, reference_output

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2)


def resubmit_of(outputs: list[list[int]], finished: tuple[int, ...] = ()) -> SubmitRequest:
    return SubmitRequest(
        "r1",
        "gw",
        pack_tokens(PROMPT),
        PARAMS,
        EOS,
        output_token_ids=tuple(pack_tokens(o) for o in outputs),
        finished_choices=finished,
        num_moves=1,
    )


async def ask(bus: InMemoryBus, req: SubmitRequest) -> SubmitReply:
    return decode(SubmitReply, await bus.request(SUBJECTS.submit, encode(req), 1))


Outputs = dict[int, list[tuple[list[int], int]]]


async def collect(outputs: asyncio.Queue[StepOutputs], num_choices: int) -> Outputs:
    """Per choice: (new tokens, running count) of each output, until ``num_choices`` ended."""
    got: Outputs = {}
    num_ended = 0
    while num_ended < num_choices:
        step = await asyncio.wait_for(outputs.get(), 2)
        for out in step.outputs:
            got.setdefault(out.index, []).append((unpack_tokens(out.new_token_ids), out.num_output_tokens))
            num_ended += out.finish_reason is not None
            assert out.finish_reason in (None, FinishReason.LENGTH), out
    return got


async def test_a_resubmitted_request_goes_on_from_each_choices_tokens() -> None:
    whole = reference_output(PROMPT, 6, 64, ignore_eos=True)
    own = [whole[0], 99]  # choice 1's tokens differ: it goes on from its own
    async with running(Config(scheduler_id="s1")) as (bus, _worker, outputs):
        reply = await ask(bus, resubmit_of([whole[:2], own]))
        assert reply.status is SubmitStatus.ACCEPTED, reply
        got = await collect(outputs, 2)
    tokens = {i: [t for new, _ in outs for t in new] for i, outs in got.items()}
    assert tokens[0] == whole[2:]  # nothing sent twice, and the same as an undisturbed run
    assert tokens[1] == reference_output(PROMPT + own, 4, 64, ignore_eos=True)
    for outs in got.values():  # the running count goes on from what the client has
        assert [count for _, count in outs] == list(range(3, 7))


async def test_a_finished_choice_is_not_run_again_and_a_retried_resubmit_is_taken_once() -> None:
    whole = reference_output(PROMPT, 6, 64, ignore_eos=True)
    async with running(Config(scheduler_id="s1")) as (bus, worker, outputs):
        req = resubmit_of([whole[:3], whole], finished=(1,))
        worker.gate.clear()  # the first is still running when the retry comes
        replies = await asyncio.gather(ask(bus, req), ask(bus, req))
        worker.gate.set()
        assert [r.status for r in replies] == [SubmitStatus.ACCEPTED] * 2, replies
        got = await collect(outputs, 1)
        await asyncio.sleep(0.05)
        assert outputs.empty()
    assert set(got) == {0}
    assert [t for new, _ in got[0] for t in new] == whole[3:]
    new_seqs = [s.seq_id for plan in worker.plans for s in plan.new_seqs]
    assert new_seqs == ["r1"]  # choice 0 only, and once


async def test_a_resubmit_that_does_not_add_up_is_invalid() -> None:
    whole = reference_output(PROMPT, 6, 64, ignore_eos=True)
    bad = [
        resubmit_of([whole[:2]]),  # outputs for one choice of two
        resubmit_of([whole[:2], whole[:2]], finished=(0, 1)),  # nothing left to run
        resubmit_of([whole[:2], whole[:2]], finished=(2,)),  # no such choice
        resubmit_of([whole, whole[:2]]),  # choice 0 has its max_tokens already
    ]
    async with running(Config(scheduler_id="s1")) as (bus, worker, _outputs):
        for req in bad:
            reply = await ask(bus, req)
            assert reply.status is SubmitStatus.INVALID and "bad resubmit" in reply.message, reply
        worker.gate.clear()  # r2 stays live while its id is reused (on a busy machine it could finish)
        assert (await submit(bus, "r2", max_tokens=50)).status is SubmitStatus.ACCEPTED
        again = await submit(bus, "r2", max_tokens=50)
        worker.gate.set()
        assert again.status is SubmitStatus.INVALID and "in use" in again.message
