"""A fleet of fake workers under one ``Fleet``, each driven like StepLoop drives a real one, with
one shared store (G3). For the fleet's tests: crashes, departures, drains and joins by name."""

from __future__ import annotations

from services.scheduler.fleet import Fleet, Moves, WorkerLoss
from services.scheduler.sequence import Sequence
from services.scheduler.worker_scheduler import Limits, WorkerScheduler
from tests.unit.scheduler.driver import Driver
from tests.unit.scheduler.fake_worker import FakeWorker

BLOCK_SIZE = 4
FINGERPRINT = "tiny"


def limits(num_blocks: int = 48, max_num_seqs: int = 4, tiers: bool = True) -> Limits:
    return Limits(
        num_blocks,
        BLOCK_SIZE,
        max_num_seqs,
        96,
        max_num_batched_tokens=16,
        max_num_waiting=64,
        watermark=0.0,
        enable_kv_tiers=tiers,
    )


class FleetSim:
    def __init__(self, migration_limit: int = 3, max_in_flight: int = 2) -> None:
        self.fleet = Fleet(migration_limit)
        self.drivers: dict[str, Driver] = {}
        self.store: dict[bytes, tuple[int | None, ...]] = {}  # G3, shared by every worker
        self.handoff: dict[bytes, tuple[int | None, ...]] = {}  # the handoff area, shared too
        self.max_in_flight = max_in_flight
        self.outputs: dict[str, list[int]] = {}  # seq id -> tokens, of sequences that finished
        self.failed: dict[str, str] = {}  # seq id -> why it was not moved
        self.num_joined = 0

    def join(self, worker_id: str = "", num_blocks: int = 48, role: str = "both") -> str:
        worker_id = worker_id or f"w{self.num_joined}"
        self.num_joined += 1
        core = WorkerScheduler(limits(num_blocks), "s1", FINGERPRINT)
        worker = FakeWorker(BLOCK_SIZE)
        worker.store = self.store
        worker.handoff = self.handoff
        self.drivers[worker_id] = Driver(core, worker, self.max_in_flight)
        self.fleet.add_worker(worker_id, core, role)
        return worker_id

    def submit(self, seq: Sequence, worker_id: str, outputs: list[list[int] | None] | None = None) -> None:
        """``outputs``: a resubmit's tokens per choice (None: that choice ended), as after its
        scheduler was lost."""
        self.fleet.submit(seq, worker_id, outputs, num_migrations=0 if outputs is None else 1)

    def step(self, worker_id: str) -> None:
        driver = self.drivers[worker_id]
        driver.step()
        for seq in driver.finished:
            self.outputs[seq.seq_id] = seq.output_token_ids
        self.fleet.finished(driver.finished)  # as the service's publish tells the table
        driver.finished.clear()

    def lose(self, worker_id: str, loss: WorkerLoss, avoid: tuple[str, ...] = ()) -> Moves:
        """The worker is gone, its plans in flight with it; ``avoid``: workers gone silent too."""
        del self.drivers[worker_id]
        moves = self.fleet.lose_worker(worker_id, loss, avoid)
        self.failed.update((seq.seq_id, why) for seq, why in moves.failed)
        return moves

    def prefilled(self) -> list[str]:
        """Requests whose prefill for a handoff is done: the service starts their handoff now."""
        return sorted(
            seq.request_id
            for core in self.fleet.cores.values()
            for seq in core.seqs.values()
            if seq.handoff and seq.num_output_tokens and seq.request_id not in self.fleet.in_transit
        )

    def hand_off(self, request_id: str) -> Moves:
        """The whole handoff at once: the prefill worker's next plans save and drop it, then
        the request lands on a decode worker."""
        worker_id = self.fleet.worker_of(request_id)
        assert worker_id is not None and self.fleet.begin_handoff(request_id, partial=True)
        while self.drivers[worker_id].sched.has_work() or self.drivers[worker_id].in_flight:
            self.step(worker_id)  # the saves reach the store before the decode worker loads
        return self.land(request_id)

    def land(self, request_id: str, num_stored_blocks: int | None = None) -> Moves:
        """A request in transit goes to a decode worker (or fails with no decode worker). As in
        the service, a partial block not written yet (the wait's bound passed) is dropped by its
        prefill worker, after its write, and recomputed instead; ``num_stored_blocks``: the
        leading blocks the wait saw written."""
        seqs, source = self.fleet.in_transit.get(request_id, ([], None))
        for seq in seqs:
            if source is not None and seq.partial_key not in self.handoff:
                source.kv_tiers.drop_partial(seq)
        moves = self.fleet.end_handoff(request_id, num_stored_blocks)
        self.failed.update((seq.seq_id, why) for seq, why in moves.failed)
        return moves

    def drain(self, worker_id: str) -> Moves:
        return self.fleet.drain(worker_id)

    def run(self) -> None:
        """Every worker until nothing is left to do anywhere."""
        while any(d.sched.has_work() or d.in_flight for d in self.drivers.values()):
            for worker_id in list(self.drivers):
                self.step(worker_id)
                self.fleet.check_integrity()

    def settle(self) -> None:
        """``run``, handing off every request whose remote prefill is done as the service would
        (a prefill worker holding only those has work no plan can do)."""
        while True:
            for request_id in self.prefilled():
                self.fleet.begin_handoff(request_id, partial=True)
            for request_id in sorted(self.fleet.in_transit):
                self.land(request_id)
            if not any(d.sched.has_work() or d.in_flight for d in self.drivers.values()):
                return
            for worker_id in list(self.drivers):
                self.step(worker_id)
                self.fleet.check_integrity()
