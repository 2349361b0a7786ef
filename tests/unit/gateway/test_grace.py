"""GracePeriods: a request is cancelled only when its last reader here leaves unfinished, after the
grace period, and not when a resume elsewhere claimed it (also a claim that came first)."""

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
