"""The fleet: one request table over several workers' cores; requests move when a worker crashes,
leaves or drains, and come out exactly as if they had run undisturbed.

Moves go through fake workers that check every position a sequence attends to (fake_worker), with
one shared store (G3) as a real deployment has, so a moved sequence that loaded wrong KV, lost a
token or repeated one shows up as an output that differs from its reference.
"""

from __future__ import annotations

import contextlib
import random

import pytest

from libs.protocol.errors import QueueFull
from libs.protocol.messages import Handback, SamplingParams
from services.scheduler.fleet import NO_TARGET, WorkerLoss
from services.scheduler.request_table import RequestTable
from services.scheduler.sequence import Sequence, SequenceStatus
from tests.unit.scheduler.fake_worker import EOS, reference_output
from tests.unit.scheduler.fleet_sim import FleetSim

CONTEXT_LEN = 96


def make_seq(request_id: str, prompt: list[int], max_tokens: int = 20, n: int = 1) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n, ignore_eos=True)
    return Sequence(request_id, "g1", prompt, params, EOS)


def want(prompt: list[int], max_tokens: int = 20) -> list[int]:
    return reference_output(prompt, max_tokens, CONTEXT_LEN, ignore_eos=True)


def steps(sim: FleetSim, worker_id: str, num_steps: int) -> None:
    for _ in range(num_steps):
        sim.step(worker_id)
        sim.fleet.check_integrity()


def test_a_crashed_workers_requests_move_and_finish_as_if_undisturbed() -> None:
    sim = FleetSim()
    w0, w1 = sim.join(), sim.join()
    prompts = {f"r{i}": [3 + i, 5, 7, 11, 13, 17, 19, 23, 29][: 4 + i] for i in range(4)}
    for request_id, prompt in prompts.items():
        sim.submit(make_seq(request_id, prompt), w0)
    steps(sim, w0, 6)  # prefilled, a few tokens in, plans in flight
    moves = sim.lose(w0, WorkerLoss.CRASHED)
    assert sorted(s.seq_id for s in moves.moved[w1]) == sorted(prompts) and not moves.failed
    sim.fleet.check_integrity()
    sim.run()
    assert sim.outputs == {r: want(p) for r, p in prompts.items()}
    assert len(sim.fleet.table) == 0


def test_a_lost_workers_requests_do_not_move_to_a_worker_gone_silent() -> None:
    sim = FleetSim()
    w0, silent, w2 = sim.join(), sim.join(), sim.join(num_blocks=8)  # the silent one is the roomier
    sim.submit(make_seq("r", [5, 6, 7, 8, 9]), w0)
    steps(sim, w0, 2)
    assert set(sim.lose(w0, WorkerLoss.CRASHED, avoid=(silent,)).moved) == {w2}
    sim.fleet.check_integrity()
    del sim.drivers[silent]  # its own loss, next, moves nothing it was just given
    assert not sim.fleet.lose_worker(silent, WorkerLoss.CRASHED).moved
    sim.run()
    assert sim.outputs == {"r": want([5, 6, 7, 8, 9])}


def test_a_request_moved_migration_limit_times_fails_at_the_next_loss() -> None:
    sim = FleetSim(migration_limit=2)
    worker = sim.join()
    sim.submit(make_seq("r", [5, 6, 7, 8, 9], max_tokens=60), worker)
    for _ in range(2):
        steps(sim, worker, 3)
        new = sim.join()
        assert sim.lose(worker, WorkerLoss.LEFT).moved[new][0].seq_id == "r"
        worker = new
    steps(sim, worker, 3)
    sim.join()
    moves = sim.lose(worker, WorkerLoss.LEFT)
    assert not moves.moved
    [(seq, why)] = moves.failed
    assert seq.seq_id == "r" and "migration limit (2 moves)" in why
    assert len(sim.fleet.table) == 0


def test_a_request_in_the_batch_at_two_crashes_fails_alone() -> None:
    """The poison crashes every worker it runs on; its batch-mates of the first crash are
    suspects too, but suspects are admitted one at a time, so the second crash finds only it."""
    sim = FleetSim()
    w0, w1, w2 = sim.join(), sim.join(), sim.join()
    sim.fleet.draining.add(w2)  # keep the moves on w1 (a draining worker takes none)
    for request_id in ("poison", "a", "b"):
        sim.submit(make_seq(request_id, [7, 8, 9, 10, 11 + len(request_id)]), w0)
    steps(sim, w0, 2)  # all three in the batch
    moves = sim.lose(w0, WorkerLoss.CRASHED)
    assert sorted(s.seq_id for s in moves.moved[w1]) == ["a", "b", "poison"]
    sim.fleet.draining.discard(w2)
    steps(sim, w1, 1)  # one suspect admitted: the poison (first in id order it is not; find it)
    core = sim.fleet.cores[w1]
    running = [s.seq_id for s in core.seqs.values() if s.status is SequenceStatus.RUNNING]
    assert len(running) == 1, running  # one suspect at a time
    poison = running[0]
    moves = sim.lose(w1, WorkerLoss.CRASHED)  # the poison's second crash
    assert [(s.seq_id, "2 worker crashes" in why) for s, why in moves.failed] == [(poison, True)]
    assert sorted(s.seq_id for s in moves.moved[w2]) == sorted({"poison", "a", "b"} - {poison})
    sim.run()
    assert set(sim.outputs) == {"poison", "a", "b"} - {poison}


def test_a_drain_moves_every_request_and_the_worker_drops_them() -> None:
    sim = FleetSim()
    w0, w1 = sim.join(), sim.join()
    for i in range(3):
        sim.submit(make_seq(f"r{i}", [4, 5, 6, 7, 8, 9, i + 3]), w0)
    steps(sim, w0, 3)
    moves = sim.drain(w0)
    assert len(moves.moved[w1]) == 3 and not sim.fleet.table.requests_on(w0)
    sim.run()  # w0's next plans tell its worker to drop them
    assert not sim.drivers[w0].worker.seqs
    assert sim.outputs == {f"r{i}": want([4, 5, 6, 7, 8, 9, i + 3]) for i in range(3)}


def test_a_drain_with_nowhere_to_go_keeps_its_requests_until_a_worker_joins() -> None:
    sim = FleetSim()
    w0 = sim.join()
    sim.submit(make_seq("r", [4, 5, 6, 7, 8]), w0)
    steps(sim, w0, 2)
    assert not sim.drain(w0).moved and sim.fleet.worker_of("r") == w0
    w1 = sim.join()
    assert [s.seq_id for s in sim.drain(w0).moved[w1]] == ["r"]
    sim.run()
    assert sim.outputs == {"r": want([4, 5, 6, 7, 8])}


def test_a_lost_worker_with_no_other_fails_its_requests_and_cancel_finds_moved_ones() -> None:
    sim = FleetSim()
    w0, w1 = sim.join(), sim.join()
    sim.submit(make_seq("r", [4, 5, 6, 7, 8], n=2), w0)
    steps(sim, w0, 3)
    sim.lose(w0, WorkerLoss.CRASHED)
    assert sim.fleet.worker_of("r#1") == w1
    worker_id, aborted = sim.fleet.cancel("r#1")
    assert worker_id == w1 and [s.seq_id for s in aborted] == ["r#1"]
    sim.fleet.check_integrity()
    moves = sim.lose(w1, WorkerLoss.CRASHED)
    assert [(s.seq_id, why) for s, why in moves.failed] == [("r", NO_TARGET)]
    # handed back to the gateway, to go on at another replica: one move and one crash so far (not
    # in the batch at the second: it had not run on w1 yet)
    assert [s.handback for s, _ in moves.failed] == [Handback(num_moves=1, num_crashes=1)]
    assert len(sim.fleet.table) == 0


def test_a_request_resubmitted_with_crashes_is_a_suspect_and_fails_at_the_crash_limit() -> None:
    """Crashes counted at other replicas carry over: one more here is its second, and it fails
    alone, not handed back; with the bus lost nothing is handed back either."""
    sim = FleetSim()
    worker = sim.join()
    seq = make_seq("r", [4, 5, 6, 7, 8])
    (choice,) = sim.fleet.submit(seq, worker, outputs=[[]], num_migrations=1, num_crashes=1)
    assert choice.suspect
    sim.fleet.check_integrity()
    steps(sim, worker, 1)
    sim.join()
    moves = sim.lose(worker, WorkerLoss.CRASHED)
    [(failed, why)] = moves.failed
    assert "2 worker crashes" in why and failed.handback is None
    other = next(iter(sim.drivers))
    sim.submit(make_seq("q", [4, 5, 6]), other)
    moves = sim.lose(other, WorkerLoss.UNREACHABLE)
    assert [(s.seq_id, s.handback) for s, _ in moves.failed] == [("q", None)]


@pytest.mark.parametrize("seed", range(12))
def test_random_submits_cancels_drains_crashes_and_joins_keep_the_table_whole(seed: int) -> None:
    """Submits (new, and resubmits going on from tokens already out), cancels, handoffs, drains,
    crashes, departures and joins in random order: the table stays whole after every event, and
    every request ends with the reference output, fails with a reason, or was cancelled, and no
    handoff file outlives its request."""
    rng = random.Random(seed)
    sim = FleetSim(migration_limit=rng.choice([1, 3]), max_in_flight=rng.choice([1, 2]))
    for _ in range(3):
        sim.join(num_blocks=rng.choice([24, 48]))
    sim.join(num_blocks=48, role="prefill")
    prompts: dict[str, tuple[list[int], int]] = {}
    cancelled: set[str] = set()
    for event in range(300):
        live = [w for w in sim.drivers if w not in sim.fleet.draining]
        decoders = [w for w in live if sim.fleet.decodes(w)]
        prefillers = [w for w in live if not sim.fleet.decodes(w)]
        kind = rng.random()
        if kind < 0.25 and decoders:
            request_id = f"r{event}"
            prompt = [rng.randrange(3, 50) for _ in range(rng.randint(1, 30))]
            max_tokens = rng.randint(1, 25)
            seq = make_seq(request_id, prompt, max_tokens, n=rng.choice([1, 1, 2]))
            handoff = bool(prefillers) and seq.sampling_params.n == 1 and rng.random() < 0.4
            seq.handoff = handoff  # prefilled there, decoded where it is handed
            with contextlib.suppress(QueueFull):  # moved requests filled that queue: a 429
                sim.submit(seq, rng.choice(prefillers if handoff else decoders))
                prompts[request_id] = (prompt, max_tokens)
        elif kind < 0.26 and decoders:  # a resubmit: its client has some tokens of each choice
            request_id = f"r{event}"
            prompt = [rng.randrange(3, 50) for _ in range(rng.randint(1, 30))]
            max_tokens = rng.randint(2, 25)
            seq = make_seq(request_id, prompt, max_tokens, n=rng.choice([1, 2]))
            have = want(prompt, max_tokens)[: rng.randint(0, max_tokens - 1)]
            outputs: list[list[int] | None] = [have, have][: seq.sampling_params.n]
            if len(outputs) == 2 and rng.random() < 0.5:
                outputs[rng.randrange(2)] = None  # that choice ended before the move
            with contextlib.suppress(QueueFull):
                sim.submit(seq, rng.choice(decoders), outputs)
                prompts[request_id] = (prompt, max_tokens)
        elif kind < 0.30 and sim.prefilled():
            sim.fleet.begin_handoff(rng.choice(sim.prefilled()), partial=rng.random() < 0.8)
        elif kind < 0.32 and sim.fleet.in_transit:
            sim.land(rng.choice(sorted(sim.fleet.in_transit)))
        elif kind < 0.33 and prompts:
            request_id = rng.choice(sorted(prompts))
            cancelled.update(s.request_id for s in sim.fleet.cancel(request_id)[1])
        elif kind < 0.36 and len(sim.drivers) > 1:
            sim.lose(rng.choice(sorted(sim.drivers)), rng.choice([WorkerLoss.CRASHED, WorkerLoss.LEFT]))
        elif kind < 0.38 and sim.drivers:
            sim.drain(rng.choice(sorted(sim.drivers)))
        elif kind < 0.41 and len(sim.drivers) < 5:
            sim.join(num_blocks=rng.choice([24, 48]))
        elif sim.drivers:
            sim.step(rng.choice(sorted(sim.drivers)))
        sim.fleet.check_integrity()
    sim.settle()  # every handoff lands
    for worker_id in list(sim.fleet.draining):  # drained empty: they leave
        if not sim.fleet.table.requests_on(worker_id) and len(sim.drivers) > 1:
            sim.settle()
            sim.lose(worker_id, WorkerLoss.LEFT)
    sim.fleet.draining.clear()
    sim.settle()
    sim.fleet.check_integrity()
    assert len(sim.fleet.table) == 0
    assert sim.handoff == {}  # every handoff file was loaded (and deleted) or dropped
    for seq_id, tokens in sim.outputs.items():
        request_id = seq_id.split("#")[0]
        if request_id not in cancelled:
            prompt, max_tokens = prompts[request_id]
            assert tokens == reference_output(prompt, max_tokens, CONTEXT_LEN, ignore_eos=True), seq_id
    ended = set(sim.outputs) | set(sim.failed)
    assert {s.split("#")[0] for s in ended} | cancelled == set(prompts)


def test_a_prefilled_request_is_handed_to_a_decode_worker_which_loads_its_prompt() -> None:
    sim = FleetSim()
    prefill, decode = sim.join(role="prefill"), sim.join(role="decode")
    prompt = [(5 * i) % 40 + 3 for i in range(30)]  # 7 full blocks of 4, and 2 tokens
    seq = make_seq("r", prompt)
    seq.handoff = True
    sim.submit(seq, prefill)
    while not sim.prefilled():
        steps(sim, prefill, 1)
    assert seq.num_output_tokens == 1  # nothing decoded on the prefill worker
    moves = sim.hand_off("r")
    assert [s.seq_id for s in moves.moved[decode]] == ["r"] and not seq.handoff
    assert not sim.drivers[prefill].worker.seqs  # dropped there, its blocks saved to the store
    num_store_loads = num_computed = 0
    while sim.drivers[decode].sched.has_work() or sim.drivers[decode].in_flight:
        plan_count = len(sim.drivers[decode].plans)
        steps(sim, decode, 1)
        for plan in sim.drivers[decode].plans[plan_count:]:
            num_store_loads += sim.drivers[decode].worker.last_loads[1]
            if plan.new_seqs:
                num_computed = plan.new_seqs[0].num_scheduled_tokens
    assert sim.outputs == {"r": want(prompt)}
    # It loaded every full prompt block and the partial last one from the handoff area (deleted
    # once read), and computed only the first output token's KV.
    assert num_store_loads == len(prompt) // 4 and num_computed == 1
    assert sim.drivers[decode].worker.num_partial_loads == [1, 0] and sim.handoff == {}


def prefilled_on(sim: FleetSim, prefill: str, request_id: str, prompt: list[int]) -> Sequence:
    seq = make_seq(request_id, prompt)
    seq.handoff = True
    sim.submit(seq, prefill)
    while request_id not in sim.prefilled():
        steps(sim, prefill, 1)
    return seq


def test_a_handoff_whose_full_blocks_did_not_all_load_drops_its_partial_block() -> None:
    """A full block missing from the store: the decode worker recomputes from it, its partial
    block included (the file is dropped); a cancel in transit drops the file through the prefill
    worker, after its write."""
    sim = FleetSim()
    prefill, decode = sim.join(role="prefill"), sim.join(role="decode")
    prompt = [(7 * i) % 40 + 3 for i in range(30)]
    seq = prefilled_on(sim, prefill, "r", prompt)
    assert sim.fleet.begin_handoff("r", partial=True)
    steps(sim, prefill, 2)  # the saves run there
    key = seq.partial_key
    assert key in sim.handoff
    del sim.store[seq.block_hashes[3]]  # and it left G2 with its worker: block 3.. recomputed
    sim.drivers[prefill].worker.host.clear()
    sim.land("r")
    sim.run()
    assert sim.outputs["r"] == want(prompt) and sim.handoff == {}
    # planned after the full blocks; past the gap the worker recomputes it and drops the file
    assert sim.drivers[decode].worker.num_partial_loads == [0, 1]
    other = prefilled_on(sim, prefill, "c", [(3 * i) % 40 + 3 for i in range(30)])
    assert sim.fleet.begin_handoff("c", partial=True) and other.partial_key
    steps(sim, prefill, 1)
    assert other.partial_key in sim.handoff
    sim.fleet.cancel("c")
    sim.run()
    assert sim.handoff == {} and len(sim.fleet.table) == 0


def test_a_handoff_given_up_loads_only_the_blocks_written_and_prefills_the_rest_in_chunks() -> None:
    """The wait saw 2 of 7 full blocks written (then silence): the decode worker is planned loads
    of those 2 only, never a load that fails (which it would recompute in one unchunked step),
    and prefills the rest in chunks of the batch budget."""
    sim = FleetSim()
    prefill, decode = sim.join(role="prefill"), sim.join(role="decode")
    prompt = [(11 * i) % 40 + 3 for i in range(30)]  # 7 full blocks of 4, and 2 tokens
    seq = prefilled_on(sim, prefill, "r", prompt)
    assert sim.fleet.begin_handoff("r", partial=True)
    steps(sim, prefill, 1)  # the saves run there; as far as the wait saw, only 2 were written
    for block_hash in seq.block_hashes[2:7]:
        del sim.store[block_hash]
    sim.drivers[prefill].worker.host.clear()
    sim.land("r", num_stored_blocks=2)
    driver = sim.drivers[decode]
    num_store_loads = num_failed = 0
    scheduled: list[int] = []
    while driver.sched.has_work() or driver.in_flight:
        plan_count = len(driver.plans)
        steps(sim, decode, 1)
        num_store_loads += driver.worker.last_loads[1]
        num_failed += driver.worker.last_loads[2]
        for plan in driver.plans[plan_count:]:
            scheduled += [n.num_scheduled_tokens for n in plan.new_seqs]
    assert sim.outputs["r"] == want(prompt) and sim.handoff == {}
    assert (num_store_loads, num_failed) == (2, 0)
    assert scheduled and max(scheduled) <= 16  # the first chunk, at most the batch budget
    sim.fleet.check_integrity()


def test_a_cancel_in_transit_ends_the_request_and_a_lost_prefill_worker_hands_nothing() -> None:
    sim = FleetSim()
    prefill, decode = sim.join(role="prefill"), sim.join(role="decode")
    for request_id in ("a", "b"):
        seq = make_seq(request_id, [3, 4, 5, 6, 7, 8, 9])
        seq.handoff = True
        sim.submit(seq, prefill)
    while len(sim.prefilled()) < 2:
        steps(sim, prefill, 1)
    assert sim.fleet.begin_handoff("a")
    sim.fleet.check_integrity()
    worker_id, aborted = sim.fleet.cancel("a")
    assert worker_id == prefill and [s.seq_id for s in aborted] == ["a"]
    assert not sim.fleet.end_handoff("a").moved  # cancelled meanwhile: nothing lands
    moves = sim.lose(prefill, WorkerLoss.CRASHED)  # "b" is prefilled again where it decodes
    assert [s.seq_id for s in moves.moved[decode]] == ["b"]
    sim.run()
    assert set(sim.outputs) == {"b"} and len(sim.fleet.table) == 0


def test_the_request_table_maps_both_ways() -> None:
    table = RequestTable()
    table.add("r", ["r", "r#1"], "w0")
    table.check_integrity()
    assert table.get("r#1") is table.get("r") and table.requests_on("w0") == ["r"]
    table.move("r", "w1")
    table.check_integrity()
    assert table.requests_on("w0") == [] and table.requests_on("w1") == ["r"]
    table.finish("r")
    table.finish("r")  # idempotent
    table.check_integrity()
    assert "r" in table and table.num_seqs == 1
    table.finish("r#1")
    table.check_integrity()
    assert len(table) == 0 and table.requests_on("w1") == []
