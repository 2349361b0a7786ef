"""A P/D handoff waits for the prefill worker's completion notices (its KV events of finished G3
writes and handoff-area writes), not for a poll of the store's index: blocks the store held
already count from one lookup; the wait ends once every saved block and the partial block are
written, when the request leaves transit (cancelled), once the prefill worker has been silent
for the bound (a live one's slow writes are waited for, up to a cap), and then says what is not
written (the leading
full blocks before it are loaded)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from libs.kvstore.block_hash import hash_blocks
from libs.protocol.messages import SamplingParams
from services.scheduler.handoff import MAX_WAIT_FACTOR, Handoffs, num_leading_written
from services.scheduler.sequence import Sequence

PROMPT = list(range(3, 20))  # 4 full blocks of 4
CHAIN = hash_blocks(PROMPT[:16], 4, "fp")


class FakeKV:
    def __init__(self, num_held: int) -> None:
        self.num_held = num_held

    async def lookup(self, block_hashes: Seq[bytes], fingerprint: str, retention_class: str = "") -> int:
        return self.num_held


class FakeFleet:
    def __init__(self) -> None:
        self.in_transit: dict[str, object] = {"r": object()}


@dataclass
class FakeHandle:
    last_seen: float  # its last load report


def handoffs(
    num_held: int, timeout_s: float = 5.0, workers: dict[str, FakeHandle] | None = None
) -> tuple[Handoffs, FakeFleet]:
    fleet = FakeFleet()
    hand = Handoffs(fleet, FakeKV(num_held), workers or {}, timeout_s, lambda moves, why: None)  # type: ignore[arg-type]
    return hand, fleet


def saved_seq(partial_key: bytes = b"") -> Sequence:
    seq = Sequence("r", "g1", PROMPT, SamplingParams(max_tokens=4), 2)
    seq.block_hashes = list(CHAIN)
    seq.num_saved_blocks = len(CHAIN)
    seq.partial_key = partial_key
    return seq


async def num_loadable(hand: Handoffs, seq: Sequence, timeout_s: float) -> int:
    """What the decode worker will load of the full blocks once the wait is over."""
    unwritten = await asyncio.wait_for(hand._wait_written(seq, "p1", "fp"), timeout_s)
    return num_leading_written(seq, unwritten)


async def test_the_wait_ends_on_the_notices_of_what_the_store_did_not_hold() -> None:
    hand, _ = handoffs(num_held=2)
    started = time.monotonic()
    wait = asyncio.create_task(num_loadable(hand, saved_seq(), 5))
    await asyncio.sleep(0.05)
    hand.written("p2", CHAIN)  # another worker's writes: no notice for this handoff
    hand.written("p1", [CHAIN[3]])
    await asyncio.sleep(0.05)
    assert not wait.done()
    hand.written("p1", [CHAIN[2]])
    assert await asyncio.wait_for(wait, 1) == 4
    assert time.monotonic() - started < 2  # long before the 5 s bound
    assert hand._waits == {}


async def test_at_the_bound_it_counts_the_leading_blocks_written() -> None:
    hand, _ = handoffs(num_held=1, timeout_s=0.3)
    wait = asyncio.create_task(num_loadable(hand, saved_seq(), 2))
    await asyncio.sleep(0.05)
    hand.written("p1", [CHAIN[2], CHAIN[3]])  # block 1 never comes: the decode worker computes 1..3
    assert await wait == 1


async def test_a_live_prefill_worker_is_waited_for_past_the_bound_up_to_its_cap() -> None:
    """The bound is on the prefill worker's silence: one that reports while it writes slowly (busy
    with the next prompt, or behind an earlier handoff's blocks) is waited for, so its decode
    worker never recomputes blocks that were about to be there; at most MAX_WAIT_FACTOR x the
    bound in all (a write its store dropped sends no notice)."""
    source = FakeHandle(time.monotonic())
    hand, _ = handoffs(num_held=0, timeout_s=0.1, workers={"p1": source})
    started = time.monotonic()
    wait = asyncio.create_task(num_loadable(hand, saved_seq(), 5))
    for block_hash in CHAIN[:3]:  # its load reports keep coming; no notice for 0.3 s at a time
        for _ in range(3):
            await asyncio.sleep(0.1)
            source.last_seen = time.monotonic()
        assert not wait.done()
        hand.written("p1", [block_hash])
    while not wait.done():  # block 3's write never comes: the cap ends the wait
        await asyncio.sleep(0.05)
        source.last_seen = time.monotonic()
    assert await wait == 3
    waited_s = time.monotonic() - started
    assert MAX_WAIT_FACTOR * 0.1 <= waited_s < MAX_WAIT_FACTOR * 0.1 + 0.5


async def test_a_cancel_in_transit_ends_the_wait() -> None:
    hand, fleet = handoffs(num_held=0)
    started = time.monotonic()
    wait = asyncio.create_task(num_loadable(hand, saved_seq(), 2))
    await asyncio.sleep(0.05)
    del fleet.in_transit["r"]
    assert await wait == 0
    assert time.monotonic() - started < 1


async def test_blocks_the_store_held_already_need_no_notice() -> None:
    hand, _ = handoffs(num_held=4)
    assert await num_loadable(hand, saved_seq(), 1) == 4


async def test_the_wait_ends_only_once_the_partial_block_is_written_too() -> None:
    hand, _ = handoffs(num_held=4)
    key = bytes(range(32))
    wait = asyncio.create_task(hand._wait_written(saved_seq(key), "p1", "fp"))
    await asyncio.sleep(0.05)
    assert not wait.done()  # every full block is stored, the partial one is not written yet
    hand.written("p1", [key])
    assert await asyncio.wait_for(wait, 1) == set()


async def test_a_partial_block_not_written_in_time_is_left_unwritten() -> None:
    hand, _ = handoffs(num_held=4, timeout_s=0.2)
    key = bytes(range(32))
    assert await asyncio.wait_for(hand._wait_written(saved_seq(key), "p1", "fp"), 2) == {key}
