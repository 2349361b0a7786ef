"""GracePeriods: a request is cancelled only when its last reader here leaves unfinished, after the
grace period, and not when a resume elsewhere claimed it (also a claim that came first). It is
paused as the grace period starts and resumed when a reader ends that period."""

from __future__ import annotations

import asyncio

from services.gateway.grace import GracePeriods

GRACE_S = 0.05


async def settle() -> None:
    await asyncio.sleep(GRACE_S * 3)


async def test_the_last_reader_leaving_starts_the_grace_period() -> None:
    cancelled: list[str] = []
    grace = GracePeriods(GRACE_S, cancelled.append)
    grace.joined("r", "grace")
    grace.joined("r", "grace")  # a resumed replay on the same gateway
    grace.left("r", "grace", finished=False)
    await settle()
    assert cancelled == []  # the other reader is still there
    grace.left("r", "grace", finished=False)
    assert cancelled == []
    await settle()
    assert cancelled == ["r"]


async def test_a_reader_joining_in_the_grace_period_keeps_it() -> None:
    cancelled: list[str] = []
    grace = GracePeriods(GRACE_S, cancelled.append)
    grace.joined("r", "grace")
    grace.left("r", "grace", finished=False)
    grace.joined("r", "grace")
    await settle()
    assert cancelled == []
    grace.left("r", "grace", finished=True)
    await settle()
    assert cancelled == []


async def test_claims_elsewhere_before_or_after_the_leave_keep_it() -> None:
    cancelled: list[str] = []
    grace = GracePeriods(GRACE_S, cancelled.append)
    for request_id, claim_first in (("a", True), ("b", False)):
        grace.joined(request_id, "grace")
        if claim_first:
            grace.claimed(request_id)  # the resume's claim overtook the disconnect
        grace.left(request_id, "grace", finished=False)
        if not claim_first:
            assert grace.claimed(request_id)
    await settle()
    assert cancelled == []


async def test_now_and_never() -> None:
    cancelled: list[str] = []
    grace = GracePeriods(GRACE_S, cancelled.append)
    grace.joined("n", "now")
    grace.left("n", "now", finished=False)
    assert cancelled == ["n"]
    grace.joined("b", "never")
    grace.left("b", "never", finished=False)
    grace.joined("g", "grace")
    grace.left("g", "grace", finished=False, failed=True)  # a failed reader: no grace
    await settle()
    assert cancelled == ["n", "g"]
    assert not grace._readers and not grace._timers  # nothing left behind


class Recorder:
    """The callbacks of one GracePeriods, in the order they came."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def cancel(self, request_id: str) -> None:
        self.calls.append(("cancel", request_id))

    def pause(self, request_id: str, resume: bool) -> None:
        self.calls.append(("resume" if resume else "pause", request_id))


async def test_a_stream_pauses_as_its_grace_period_starts_and_is_cancelled_at_its_end() -> None:
    rec = Recorder()
    grace = GracePeriods(GRACE_S, rec.cancel, rec.pause)
    grace.joined("r", "grace")
    grace.joined("r", "grace")
    grace.left("r", "grace", finished=False)
    assert rec.calls == []  # another reader still reads it: it keeps running
    grace.left("r", "grace", finished=False)
    assert rec.calls == [("pause", "r")]  # at once, not after the grace period
    await settle()
    assert rec.calls == [("pause", "r"), ("cancel", "r")]


async def test_a_reader_back_here_or_a_claim_elsewhere_resumes_it() -> None:
    rec = Recorder()
    grace = GracePeriods(GRACE_S, rec.cancel, rec.pause)
    for request_id in ("here", "elsewhere"):
        grace.joined(request_id, "grace")
        grace.left(request_id, "grace", finished=False)
    grace.joined("here", "grace")
    assert grace.claimed("elsewhere")
    assert not grace.claimed("elsewhere")  # resumed once only
    await settle()
    assert rec.calls == [
        ("pause", "here"),
        ("pause", "elsewhere"),
        ("resume", "here"),
        ("resume", "elsewhere"),
    ]
    grace.left("here", "grace", finished=True)
    await settle()
    assert len(rec.calls) == 4  # finished: nothing to pause or cancel


async def test_a_leave_after_a_claim_elsewhere_neither_pauses_nor_cancels() -> None:
    """The resume's claim overtook the disconnect it answers: the resuming reader runs it now."""
    rec = Recorder()
    grace = GracePeriods(GRACE_S, rec.cancel, rec.pause)
    grace.joined("r", "grace")
    grace.claimed("r")
    grace.left("r", "grace", finished=False)
    await settle()
    assert rec.calls == []


async def test_only_a_resumable_stream_pauses() -> None:
    rec = Recorder()
    grace = GracePeriods(GRACE_S, rec.cancel, rec.pause)
    grace.joined("n", "now")
    grace.left("n", "now", finished=False)
    grace.joined("b", "never")
    grace.left("b", "never", finished=False)
    grace.joined("f", "grace")
    grace.left("f", "grace", finished=False, failed=True)
    no_grace = GracePeriods(0.0, rec.cancel, rec.pause)
    no_grace.joined("z", "grace")
    no_grace.left("z", "grace", finished=False)
    await settle()
    assert rec.calls == [("cancel", "n"), ("cancel", "f"), ("cancel", "z")]
