"""Runs a scheduler core's plans through a FakeWorker the way StepLoop does (up to
``max_in_flight`` plans in flight), checking integrity after every plan and result."""

from __future__ import annotations

from libs.protocol.messages import NewSequence, SchedulerOutput
from services.scheduler.sequence import Sequence
from services.scheduler.worker_scheduler import WorkerScheduler
from tests.unit.scheduler.fake_worker import FakeWorker, reference_output


class Driver:
    """Plans through a FakeWorker like StepLoop (up to ``max_in_flight``), checking integrity after
    every plan and result; ``events`` forwards the worker's G2 events to the core after each step."""

    def __init__(
        self,
        sched: WorkerScheduler,
        worker: FakeWorker | None = None,
        max_in_flight: int = 1,
        events: bool = True,
    ) -> None:
        self.sched = sched
        self.worker = worker or FakeWorker(sched.limits.block_size)
        self.max_in_flight = max_in_flight
        self.events = events
        self.in_flight: list[tuple[tuple[str, ...], list[int]]] = []
        self.plans: list[SchedulerOutput] = []
        self.outputs: dict[str, list[int]] = {}
        self.finished: list[Sequence] = []  # sequences finished by results, not yet taken

    def step(self) -> None:
        plan = self.sched.next_plan(len(self.in_flight), self.max_in_flight)
        if plan is not None:
            self.plans.append(plan)
            self.in_flight.append(self.worker.execute(plan))
            num_host, num_store, _ = self.worker.last_loads
            self.sched.record_loads(plan.step_id, num_host, num_store, self.worker.last_failed_loads)
            self.sched.check_integrity()
        if self.in_flight and (plan is None or len(self.in_flight) >= self.max_in_flight):
            for seq in self.sched.postprocess(*self.in_flight.pop(0)):
                if seq.is_finished:
                    self.outputs[seq.seq_id] = seq.output_token_ids
                    self.finished.append(seq)
            self.sched.check_integrity()
        if self.events:
            forward_host_events(self.worker, self.sched)

    def run(self) -> dict[str, list[int]]:
        while self.sched.has_work() or self.in_flight:
            self.step()
        return self.outputs

    def admissions(self, seq_id: str) -> list[NewSequence]:
        return [new for plan in self.plans for new in plan.new_seqs if new.seq_id == seq_id]

    def serve(self, seq: Sequence) -> NewSequence:
        """Add ``seq`` and run until idle; returns its first admission, after checking its output."""
        self.sched.add(seq)
        self.run()
        want = reference_output(seq.prompt_token_ids, seq.sampling_params.max_tokens, 64, ignore_eos=True)
        assert self.outputs[seq.seq_id] == want
        return self.admissions(seq.seq_id)[0]


def forward_host_events(worker: FakeWorker, sched: WorkerScheduler) -> None:
    for stored, block_hashes in worker.take_host_events():
        if stored:
            sched.note_host_blocks(stored=block_hashes)
        elif block_hashes:
            sched.note_host_blocks(removed=block_hashes)
        else:
            sched.note_host_blocks(cleared=True)
        sched.check_integrity()
