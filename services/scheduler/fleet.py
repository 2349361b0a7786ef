"""The workers one scheduler drives and the requests on them: one ``WorkerScheduler`` per worker
and one ``RequestTable``. Submit, cancel, pause and the moving of requests off a worker that
drains or is lost. Pure: no nats, asyncio or torch (the service adapts bus messages to it).

What happens to a lost worker's requests (``WorkerLoss``):
- CRASHED (its step failed, it went silent or got stuck): each request moves to the best other
  worker, up to ``migration_limit`` times. One that had a sequence in the batch is charged a
  crash; a suspect is admitted alone among suspects, and at ``max_crashes`` it fails alone
  instead of taking the next worker down.
- LEFT (another scheduler took it, or it drained past its timeout): moved, no crash charged.
- UNREACHABLE (this scheduler lost the bus): every worker goes at once, nothing can move; fail.

A request that may move but finds no other worker here is handed back (``Handback``): it ends
here with an error that tells the gateway to resubmit it to another replica, where it goes on
from the tokens its client has received, with its moves and crashes counted on.

P/D handoff: a request prefilled on a prefill worker leaves it after its first token
(``begin_handoff``: detached, its computed full blocks queued for saving to the shared store, its
partial last prompt block to the handoff area) and waits in transit until the caller has seen
them written; ``end_handoff`` attaches it to the best decode worker, which loads them and
computes only the first output token's KV (and whatever did not load). Moves never target a
prefill worker.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field

from libs.protocol.messages import FinishReason, Handback
from services.scheduler.moving import attach, detach, take_all
from services.scheduler.request_table import RequestEntry, RequestTable
from services.scheduler.router import WorkerState, pick_worker
from services.scheduler.sequence import Sequence, SequenceStatus
from services.scheduler.worker_scheduler import WorkerScheduler

NO_TARGET = "no other worker to move it to"
MAX_CRASHES = 2  # worker crashes a request may be in the batch of; at this many it fails alone


class WorkerLoss(enum.Enum):
    CRASHED = enum.auto()
    LEFT = enum.auto()
    UNREACHABLE = enum.auto()


@dataclass(slots=True)
class Moves:
    """Where requests went: target worker id -> the sequences queued there; and those failed
    instead, with why (the caller words the error around it)."""

    moved: dict[str, list[Sequence]] = field(default_factory=lambda: defaultdict(list))
    failed: list[tuple[Sequence, str]] = field(default_factory=list)


class Fleet:
    def __init__(self, migration_limit: int = 3, max_crashes: int = MAX_CRASHES) -> None:
        self.migration_limit = migration_limit
        self.max_crashes = max_crashes
        self.cores: dict[str, WorkerScheduler] = {}
        self.table = RequestTable()
        self.draining: set[str] = set()
        self.roles: dict[str, str] = {}  # worker id -> prefill | decode | both
        # request id -> (its sequences, the core they left): handed off, not yet attached
        self.in_transit: dict[str, tuple[list[Sequence], WorkerScheduler]] = {}
        self.num_migrations = 0  # since start, for metrics
        self.num_drain_moves = 0

    def add_worker(self, worker_id: str, core: WorkerScheduler, role: str = "both") -> None:
        assert worker_id not in self.cores
        self.cores[worker_id] = core
        self.roles[worker_id] = role
        self.draining.discard(worker_id)

    def decodes(self, worker_id: str) -> bool:
        """Whether the worker takes whole requests (a prefill worker takes only handoffs)."""
        return self.roles.get(worker_id, "both") != "prefill"

    def submit(
        self,
        seq: Sequence,
        worker_id: str,
        outputs: list[list[int] | None] | None = None,
        num_migrations: int = 0,
        num_crashes: int = 0,
    ) -> list[Sequence]:
        """Queue a new request on a worker (raises QueueFull); returns its sequences. A request
        resubmitted after its scheduler was lost (or handed it back) goes on from ``outputs``
        (see ``WorkerScheduler.add``), its moves and crashes so far counted against the limits."""
        choices = self.cores[worker_id].add(seq, outputs)
        self.table.add(seq.request_id, [c.seq_id for c in choices], worker_id, num_migrations, num_crashes)
        for choice in choices:
            choice.suspect = num_crashes > 0
        return choices

    def worker_of(self, request_or_seq_id: str) -> str | None:
        entry = self.table.get(request_or_seq_id)
        return None if entry is None else entry.worker_id

    def cancel(self, request_or_seq_id: str) -> tuple[str, list[Sequence]]:
        """Abort a request (or one choice): (its worker, the sequences aborted); ("", []) if unknown."""
        worker_id = self.worker_of(request_or_seq_id)
        if worker_id is None:
            return "", []
        entry = self.table.get(request_or_seq_id)
        if entry is not None and entry.request_id in self.in_transit:
            seqs, source = self.in_transit.pop(entry.request_id)
            self._end(seqs, FinishReason.ABORT, source)
            return worker_id, seqs
        aborted = self.cores[worker_id].abort(request_or_seq_id)
        self.finished(aborted)
        return worker_id, aborted

    def pause(self, request_or_seq_id: str, deadline: float, resume: bool) -> tuple[str, list[Sequence]]:
        """Pause (or resume) a request: (its worker, the sequences that changed)."""
        worker_id = self.worker_of(request_or_seq_id)
        if worker_id is None:
            return "", []
        core = self.cores.get(worker_id)
        if core is None:  # in transit from a worker gone since: not paused (its gateway cancels)
            return "", []
        changed = core.resume(request_or_seq_id) if resume else core.pause(request_or_seq_id, deadline)
        return worker_id, changed

    def expire_paused(self, now: float) -> list[Sequence]:
        expired = [s for core in self.cores.values() for s in core.expire_paused(now)]
        self.finished(expired)
        return expired

    def finished(self, seqs: list[Sequence]) -> None:
        """Sequences a core finished (published by the caller) leave the table."""
        for seq in seqs:
            if seq.is_finished:
                self.table.finish(seq.seq_id)

    # --- moving ------------------------------------------------------------------------------

    def drain(self, worker_id: str) -> Moves:
        """The worker takes no new requests; those it holds move to other workers now (any with
        no target stay and finish there). Called again, it moves what can move then."""
        self.draining.add(worker_id)
        core, moves = self.cores[worker_id], Moves()
        for request_id in self.table.requests_on(worker_id):
            if request_id in self.in_transit:
                continue  # already leaving
            target = self._pick_target(core._unfinished(request_id), exclude={worker_id})
            if target is not None:
                self._attach(detach(core, request_id), core, target, False, moves)
                self.table.move(request_id, target)
                self.num_drain_moves += 1
        return moves

    def lose_worker(self, worker_id: str, loss: WorkerLoss, avoid: Collection[str] = ()) -> Moves:
        """The worker is gone: its core is dropped and its requests move or fail (see the module).
        ``avoid``: workers not to move them to (their heartbeat stopped: they are next to go)."""
        core = self.cores.pop(worker_id)
        self.roles.pop(worker_id, None)
        self.draining.discard(worker_id)
        drops = core.kv_tiers.take_drops()  # handoff files any other worker can delete
        dropper = self._dropper()
        if drops and dropper is not None:
            dropper.kv_tiers.queue_drops(drops)
        seqs, in_batch = take_all(core)
        by_request: dict[str, list[Sequence]] = defaultdict(list)
        for seq in seqs:
            by_request[seq.request_id].append(seq)
        moves = Moves()
        for request_id, request_seqs in sorted(by_request.items()):
            request_seqs.sort(key=lambda s: s.index)
            entry = self.table.get(request_id)
            assert entry is not None and entry.worker_id == worker_id
            if loss is WorkerLoss.CRASHED and request_id in in_batch:
                entry.num_crashes += 1
            why = self._why_not_move(entry, loss)
            target = None if why else self._pick_target(request_seqs, exclude={worker_id, *avoid})
            if target is None:
                if not why and loss is not WorkerLoss.UNREACHABLE:
                    handback = Handback(entry.num_migrations, entry.num_crashes)
                    for seq in request_seqs:
                        seq.handback = handback
                self._fail(request_seqs, why or NO_TARGET, moves)
                continue
            entry.num_migrations += 1
            self.num_migrations += 1
            self._attach(request_seqs, core, target, entry.num_crashes > 0, moves)
            self.table.move(request_id, target)
        return moves

    def begin_handoff(self, request_id: str, partial: bool = False) -> list[Sequence]:
        """A prefilled request leaves its prefill worker as in a preemption and waits in transit;
        returns its sequences ([] if it is gone or already in transit). ``partial``: the worker
        has a handoff area, and saves each prompt's partial last block there too."""
        entry = self.table.get(request_id)
        if entry is None or request_id in self.in_transit or entry.worker_id not in self.cores:
            return []
        core = self.cores[entry.worker_id]
        for seq in core._unfinished(request_id) if partial else []:
            if seq.status is SequenceStatus.RUNNING:
                core.kv_tiers.queue_partial_save(seq, core.block_manager.block_tables[seq.seq_id])
        seqs = detach(core, request_id)
        if seqs:
            self.in_transit[request_id] = (seqs, core)
        return seqs

    def end_handoff(self, request_id: str, num_stored_blocks: int | None = None) -> Moves:
        """Attach a request in transit to the best decode worker (nothing if it was cancelled).
        ``num_stored_blocks``: the leading blocks of its prompt seen written to the shared store;
        only these are planned as loads (a load that fails is recomputed in one step, unchunked)."""
        moves = Moves()
        if request_id not in self.in_transit:
            return moves
        seqs, source = self.in_transit.pop(request_id)
        entry = self.table.get(request_id)
        assert entry is not None
        target = self._pick_target(seqs, exclude={entry.worker_id})
        if target is None:
            self._fail(seqs, "no decode worker to hand it to", moves, source)
            return moves
        self._attach(seqs, source, target, False, moves)
        if num_stored_blocks is not None:
            for seq in seqs:  # (a target that hashes otherwise has 0 already)
                seq.num_stored_blocks = min(seq.num_stored_blocks, num_stored_blocks)
        self.table.move(request_id, target)
        return moves

    def _why_not_move(self, entry: RequestEntry, loss: WorkerLoss) -> str:
        if loss is WorkerLoss.UNREACHABLE:
            return NO_TARGET  # every worker goes at once
        if entry.num_crashes >= self.max_crashes:
            return f"it was in the batch at {entry.num_crashes} worker crashes (a likely cause)"
        if entry.num_migrations >= self.migration_limit:
            return f"the migration limit ({self.migration_limit} moves) is reached"
        return ""

    def _pick_target(self, seqs: list[Sequence], exclude: Collection[str]) -> str | None:
        """The best worker for a request by the submit's rule: cached prefix against load."""
        head = seqs[0]
        tokens = head.token_ids(0, head.num_tokens)
        chains: dict[tuple[int, str], list[bytes]] = {}  # workers that hash alike share one chain
        states = []
        for worker_id, core in self.cores.items():
            if worker_id in exclude or worker_id in self.draining or not self.decodes(worker_id):
                continue
            kind = (core.limits.block_size, core.kv_tiers.model_fingerprint)
            if kind not in chains:
                chains[kind] = core.kv_tiers.prompt_chain(tokens, head.tenant, head.image_spans)
            chain = chains[kind]
            num_cached = core.kv_tiers.num_reusable_blocks(chain)
            states.append(
                WorkerState(worker_id, len(core.seqs), core.limits.max_num_seqs, num_cached, len(chain))
            )
        return pick_worker(states)

    def _attach(
        self, seqs: list[Sequence], source: WorkerScheduler, target_id: str, suspect: bool, moves: Moves
    ) -> None:
        target = self.cores[target_id]
        same_chain = (source.limits.block_size, source.kv_tiers.model_fingerprint) == (
            target.limits.block_size,
            target.kv_tiers.model_fingerprint,
        )
        for seq in seqs:
            seq.handoff = False  # a decode worker computes whatever it lacks itself
        attach(target, seqs, same_chain, suspect)
        moves.moved[target_id].extend(seqs)

    def _fail(
        self, seqs: list[Sequence], why: str, moves: Moves, source: WorkerScheduler | None = None
    ) -> None:
        self._end(seqs, FinishReason.ERROR, source)
        moves.failed.extend((seq, why) for seq in seqs)

    def _end(self, seqs: list[Sequence], reason: FinishReason, source: WorkerScheduler | None = None) -> None:
        """Finish sequences no core holds (lost or in transit). A handoff's partial block that no
        plan will load is dropped by ``source`` (the prefill worker: after its write) if it is
        still driven, else by any worker (the area is shared; what none drops is swept)."""
        dropper = self._dropper(source)
        for seq in seqs:
            if dropper is not None:
                dropper.kv_tiers.drop_partial(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
        self.finished(seqs)

    def _dropper(self, preferred: WorkerScheduler | None = None) -> WorkerScheduler | None:
        """The core whose next plan deletes handoff files: ``preferred`` while it is driven (its
        worker deletes after its own writes), else any (the area is shared); None with none."""
        cores = list(self.cores.values())
        return preferred if preferred in cores else next(iter(cores), None)

    def check_integrity(self) -> None:
        """The table and the cores agree: each request's sequences are on the worker it names."""
        self.table.check_integrity()
        assert self.draining <= set(self.cores), "a draining worker that is not driven"
        for worker_id, core in self.cores.items():
            core.check_integrity()
            for seq_id, seq in core.seqs.items():
                entry = self.table.get(seq_id)
                assert entry is not None and seq_id in entry.seq_ids, f"{seq_id} is not in the table"
                assert entry.worker_id == worker_id, f"{seq_id} is on {worker_id}, the table says elsewhere"
                assert not seq.is_finished
        assert set(self.roles) == set(self.cores)
        placed = sum(len(core.seqs) for core in self.cores.values())
        for request_id, (seqs, _) in self.in_transit.items():
            entry = self.table.get(request_id)
            assert entry is not None and entry.seq_ids == {s.seq_id for s in seqs}
            held = self.cores[entry.worker_id].seqs if entry.worker_id in self.cores else {}
            assert not any(s.is_finished for s in seqs)
            assert not any(s.seq_id in held for s in seqs), "in transit and held by a core"
            placed += len(seqs)
        assert placed == self.table.num_seqs, "the table holds a sequence no worker has"
