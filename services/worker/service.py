"""Adapts bus messages to the ModelRunner: step request -> forward in a thread -> reply + load.

The worker serves one scheduler at a time, its owner: the first scheduler to send a plan. Plans
from any other scheduler are refused while the owner lives, because block tables are the
owner's. The worker lets go of a silent owner gone from the members bucket for a TTL, and of an
owner that holds sequences here but has been silent for ``orphan_timeout_s`` (its sequences are
dropped). An owner whose step ids start again (it dropped this worker and claims it afresh) gets
a worker holding nothing of what it had before.

Its heartbeat (``member_info``) says whom it serves and how long the running step has run: past
``max_step_s`` it is stuck, and neither the gateway's /health nor the scheduler counts on it.

SIGTERM drains it (``drain``): its heartbeat and load say ``draining``, so its owner sends it no
new sequences and moves those held here elsewhere, while it keeps serving the owner's plans until
it holds nothing, ``drain_timeout_s`` passes or the stop is hurried. Only then does it leave.

With KV tiers it also publishes their events (``KVEvents``, seq +1 per message, the first one
saying this worker's G2 starts empty), answers ``KVDumpRequest`` with its G2 content without
waiting for a running step, and publishes ``KVCacheStats`` with each periodic load report. With a
handoff area, the same messages carry the notices of its finished writes, and it sweeps the area.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from libs.bus.base import Bus, Message
from libs.bus.membership import MEMBER_TTL_S, REFRESH_S, announce, live_members
from libs.protocol.codec import DecodeError, decode, decode_or_warn, encode
from libs.protocol.kv_messages import (
    CacheTier,
    KVCacheStats,
    KVDump,
    KVDumpRequest,
    KVEvent,
    KVEvents,
    RemovalReason,
    join_hashes,
)
from libs.protocol.member_messages import MemberInfo, MemberKind, StepSample, WorkerLoad
from libs.protocol.messages import ModelRunnerOutput, SchedulerOutput
from libs.protocol.subjects import Subjects
from libs.runtime.process import StopEvent, busy
from services.worker import metrics
from services.worker.config import Config
from services.worker.handoff_area import HandoffArea
from services.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)

# How often a drain looks at what is held: steps end and orphans are dropped in other tasks.
DRAIN_POLL_S = 0.05
SWEEP_MAX_S = 60.0  # the longest between two sweeps of the handoff area


class WorkerService:
    def __init__(
        self,
        config: Config,
        bus: Bus,
        runner: ModelRunner,
        max_model_len: int,
        model_name: str,
        model_fingerprint: str = "",
        step_profile: tuple[StepSample, ...] = (),
    ) -> None:
        self.config = config
        self.bus = bus
        self.runner = runner
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.model_fingerprint = model_fingerprint
        self.step_profile = step_profile  # steps timed at start, for its owner's speculative policy
        self.kv_seq = 0  # of the last KVEvents published
        self._publishing_kv = asyncio.Lock()  # KVEvents leave in seq order
        self._written = asyncio.Event()  # a G3 write's event waits in the outbox
        self.subjects = Subjects(config.subject_prefix)
        self._last_step_ms = 0.0
        self.owner = ""  # the scheduler this worker serves ("": none yet)
        self._owner_seen = 0.0  # monotonic time of the owner's last plan
        self._stepping = asyncio.Lock()  # orphan checks never run while a step holds the runner
        self._steps: set[asyncio.Task[None]] = set()  # steps accepted, running or waiting their turn
        self._step_started = 0.0  # monotonic start of the running forward (0: none), for heartbeats
        self._last_step_id = 0  # of the owner's last plan, in arrival order
        self._owner_absent_since: float | None = None  # the silent owner first missed from membership
        self.draining = False  # told to stop: taking no new sequences, leaving once it holds none
        # Every forward on one thread. The OpenMP runtime keeps a team of threads per calling
        # thread, and a team spins for a while after each parallel region: forwards spread over
        # the default executor's threads left several teams spinning at once, each stealing the
        # cores the running one needed (measured: 4 threads busy for a 2-thread forward).
        self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-step")

    async def close_step_thread(self) -> None:
        """Once any step still on the step thread has ended: nothing runs there after this."""
        await asyncio.to_thread(self._step_thread.shutdown, True)

    async def on_step_thread(self, fn: Callable[[ModelRunner], None]) -> None:
        """``fn(runner)`` on the thread every forward runs on (warm-up, before ``run``)."""
        await asyncio.get_running_loop().run_in_executor(self._step_thread, fn, self.runner)

    async def run(self, stop: asyncio.Event) -> None:
        subs = [await self.bus.subscribe(self.subjects.worker_step(self.config.worker_id), self.on_step)]
        tiers, handoff = self.runner.kv_tiers, self.runner.transfer.handoff
        await self.publish_kv_events()  # seq 1: this worker's G2 starts empty
        loop = asyncio.get_running_loop()
        if tiers is not None:
            subs.append(await self.bus.subscribe(self.subjects.kv_dump(self.config.worker_id), self.on_dump))
            tiers.on_written = lambda: self._wake_soon(loop)
        if handoff is not None:
            handoff.on_done = lambda: self._wake_soon(loop)
        log.info("worker %s ready (max_num_seqs=%d)", self.config.worker_id, self.config.max_num_seqs)
        # Set once the drain is over: the heartbeat and load reports (with their orphan checks)
        # go on while draining, then the worker leaves the members bucket.
        leaving = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(announce(self.bus, self.subjects.members_bucket, self.member_info, leaving))
            tg.create_task(self._report_load(leaving))
            tg.create_task(self._publish_written(leaving))
            if handoff is not None:
                tg.create_task(self._sweep_handoffs(handoff, leaving))
            await stop.wait()
            await self.drain(stop)
            leaving.set()
            self._written.set()  # the notices' task looks at ``leaving`` and ends
            for sub in subs:
                await sub.unsubscribe()
            await asyncio.gather(*self._steps)  # accepted steps still run and reply
        self._step_thread.shutdown(wait=False)

    async def drain(self, stop: asyncio.Event) -> None:
        """Serve the owner's plans until nothing is held here and no step is running or queued,
        ``drain_timeout_s`` has passed, or ``stop.hurried`` is set.

        ``draining`` goes out in a load report at once, so the owner moves the sequences held here
        (its plans name them in ``finished_seq_ids``). An owner that is gone meanwhile is let go by
        the orphan checks of the load reports, which empties the runner and so ends the drain.
        """
        self.draining = True
        started = time.monotonic()
        log.info(
            "draining: %d sequences held (owner %r), for up to %.0f s",
            *(self.runner.num_running_seqs, self.owner, self.config.drain_timeout_s),
        )
        try:
            await self._publish_load()
        except Exception as exc:  # the periodic report says it again
            log.warning("load report failed: %r", exc)
        hurried = stop.hurried if isinstance(stop, StopEvent) else asyncio.Event()
        deadline = started + self.config.drain_timeout_s
        while not self._drained() and not hurried.is_set():
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(hurried.wait(), min(remaining_s, DRAIN_POLL_S))
        why = "nothing held" if self._drained() else "hurried" if hurried.is_set() else "timed out"
        log.info(
            "drain over after %.1f s (%s): %d sequences and %d steps left",
            *(time.monotonic() - started, why, self.runner.num_running_seqs, len(self._steps)),
        )

    def _drained(self) -> bool:
        return self.runner.num_running_seqs == 0 and not self._steps

    async def on_step(self, msg: Message) -> None:
        if not msg.data:  # a liveness probe from the owner, whose step reply is slow: answered now
            await self.bus.respond(msg, b"")
            return
        try:
            plan = decode(SchedulerOutput, msg.data)
        except DecodeError as exc:
            await self.bus.respond(msg, encode(ModelRunnerOutput(0, (), b"", 0, error=str(exc))))
            return
        if self.owner and plan.scheduler_id != self.owner:
            refusal = f"worker {self.config.worker_id} is owned by scheduler {self.owner}"
            num_running = self.runner.num_running_seqs
            await self.bus.respond(
                msg, encode(ModelRunnerOutput(plan.step_id, (), b"", num_running, error=refusal))
            )
            return
        # The owner's step ids start again: it dropped this worker (it thought it dead, or lost the
        # bus) and claims it anew with a fresh core, which knows none of the sequences held here.
        restart = plan.scheduler_id == self.owner and plan.step_id <= self._last_step_id
        self.owner, self._last_step_id = plan.scheduler_id, plan.step_id
        # Overlap scheduling sends the next plan while one runs. Its G3 reads start now, during
        # the step in progress, and its step waits in a task of its own: the bus hands a
        # subscription's messages over one at a time, so awaiting the step here would hold this
        # plan back until the previous reply. Steps still run one at a time in arrival order
        # (tasks start in creation order; the lock's waiters are FIFO).
        self.runner.prefetch(plan)
        task = asyncio.create_task(self._step(msg, plan, restart))
        self._steps.add(task)
        task.add_done_callback(self._steps.discard)

    async def _step(self, msg: Message, plan: SchedulerOutput, restart: bool = False) -> None:
        async with self._stepping:
            if restart and self.runner.seqs:  # under the lock: the steps before it have run
                log.warning(
                    "scheduler %s claimed this worker again: %d old sequences dropped",
                    plan.scheduler_id,
                    self.runner.num_running_seqs,
                )
                self.runner.reset()
            start = time.perf_counter()
            self._step_started = time.monotonic()
            try:
                # The forward runs off the event loop so load reports and other messages keep flowing.
                with busy():  # the watchdog ends the process if a step outlives max_step_s
                    loop = asyncio.get_running_loop()
                    result = await loop.run_in_executor(self._step_thread, self.runner.execute, plan)
            except Exception as exc:
                # Only a PlanError or a model that fails every row gets here: one bad sequence
                # fails alone inside execute (the result's failed_seq_ids).
                log.exception("step %d failed", plan.step_id)
                self.runner.reset()  # the scheduler fails every request it had here
                result = ModelRunnerOutput(plan.step_id, (), b"", 0, error=repr(exc))
            self._owner_seen = time.monotonic()
            self._step_started = 0.0
            self._last_step_ms = (time.perf_counter() - start) * 1e3
            metrics.observe_step(self._last_step_ms / 1e3, result)
        try:
            await self.bus.respond(msg, encode(result))
            await self._publish_load()
            await self.publish_kv_events()
        except Exception:  # nobody awaits this task: say it here
            log.exception("step %d: reply or reports failed", plan.step_id)

    def member_info(self) -> MemberInfo:
        """This worker's heartbeat: whether a step is running and for how long, against its bound."""
        started = self._step_started
        return MemberInfo(
            MemberKind.WORKER,
            self.config.worker_id,
            model=self.model_name,
            step_s=time.monotonic() - started if started else 0.0,
            max_step_s=self.config.max_step_s,
            owner=self.owner,
            draining=self.draining,
            role=self.config.role,
            device=self.config.device.split(":")[0],
        )

    def load(self) -> WorkerLoad:
        return WorkerLoad(
            worker_id=self.config.worker_id,
            num_running_seqs=self.runner.num_running_seqs,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            num_kv_blocks=self.runner.kv_cache.num_blocks,
            block_size=self.runner.block_size,
            step_time_ms=self._last_step_ms,
            model=self.model_name,
            owner=self.owner,
            model_fingerprint=self.model_fingerprint,
            has_kv_store=self.runner.kv_tiers is not None and self.runner.kv_tiers.store is not None,
            has_handoff_area=self.runner.transfer.handoff is not None,
            draining=self.draining,
            role=self.config.role,
            kv_bytes_per_token=self.runner.kv_cache.bytes_per_token,
            step_profile=self.step_profile,
        )

    async def _publish_load(self) -> None:
        await self.bus.publish(self.subjects.load(self.config.worker_id), encode(self.load()))

    async def publish_kv_events(self) -> None:
        """The tiers' events and the handoff area's notices since the last message, if any (the
        first message always goes)."""
        tiers, handoff = self.runner.kv_tiers, self.runner.transfer.handoff
        if tiers is None and handoff is None:
            return
        async with self._publishing_kv:
            # Drained and numbered with no await in between: on_dump relies on it.
            events = tiers.drain_events() if tiers is not None else []
            keys = handoff.drain_done() if handoff is not None else []
            if self.kv_seq == 0:
                events.insert(0, KVEvent(CacheTier.HOST, False, b"", RemovalReason.CLEARED))
            if not events and not keys:
                return
            self.kv_seq += 1
            message = KVEvents(
                self.config.worker_id,
                self.kv_seq,
                tuple(events),
                self.model_fingerprint,
                handoff_keys=join_hashes(keys),
            )
            await self.bus.publish(self.subjects.kv_events, encode(message))

    async def on_dump(self, msg: Message) -> None:
        """G2's content, with the seq of the last KVEvents published; answered at once, even while
        a step runs (a CPU step may take longer than the consumer waits for a dump).

        Why that is consistent for a consumer, which replaces its view by the dump and then applies
        every message after ``seq`` in order: the seq is read first, and a message's events are
        drained and its seq taken in one go on this loop, so every event published by ``seq`` was
        in the outbox before the G2 read below; each event enters the outbox with its change, under
        the tiers' lock (``KVTiers._put_host``), so the read sees all those changes. It may see
        later ones too, whose events are still in the outbox or drained since: they come with
        higher seqs and are applied on top. Every event says "these blocks are in" or "are out",
        so applying one the dump already reflects changes nothing, and the view converges to G2.
        """
        tiers = self.runner.kv_tiers
        if decode_or_warn(KVDumpRequest, msg.data, log, "KV dump request") is None:
            return
        assert tiers is not None  # subscribed only with tiers
        seq = self.kv_seq  # before the read: see above
        # Off the loop: the lock may be held for one G2 copy of the running step.
        host_block_hashes = await asyncio.to_thread(tiers.dump)
        dump = KVDump(self.config.worker_id, seq, join_hashes(host_block_hashes))
        await self.bus.respond(msg, encode(dump))

    async def _publish_stats(self) -> None:
        tiers = self.runner.kv_tiers
        if tiers is None:
            return
        stats = KVCacheStats(self.config.worker_id, "worker", tiers.stats())
        await self.bus.publish(self.subjects.stats("worker", self.config.worker_id), encode(stats))

    async def drop_orphans(self) -> int:
        """Let go of an owner that is gone; returns how many of its sequences were dropped.

        An owner with sequences here sends steps back to back, so silence for
        ``orphan_timeout_s`` while holding them means it died or lost this worker; they would
        otherwise hold KV pages forever. An owner silent past the member TTL is also let go once
        it has been missing from the members bucket for one more TTL: its entry expired and it
        did not come back to refresh it, so it is not merely busy. A live one just claims the
        worker again with its next plan.

        While draining, an owner silent for a refresh period and missing from one read is let go:
        a live one refreshes its entry every ``REFRESH_S``, and this worker is leaving anyway (its
        owner, if alive after all, sees it leave and moves its sequences then).
        """
        if not self.owner:
            return 0
        seen = self._owner_seen
        now = time.monotonic()
        silent_s = now - seen
        if self.runner.seqs and silent_s > self.config.orphan_timeout_s:
            gone = True
        elif silent_s > MEMBER_TTL_S or (self.draining and silent_s > REFRESH_S):
            gone = await self._owner_missing(now)
        else:
            self._owner_absent_since = None
            gone = False
        if not gone:
            return 0
        async with self._stepping:
            if self._owner_seen != seen:
                return 0  # the owner stepped while membership was being checked
            num_freed = self.runner.num_running_seqs  # all of them are the owner's
            self.runner.reset()
            log.warning("scheduler %r is gone: released, %d sequences dropped", self.owner, num_freed)
            self.owner, self._last_step_id, self._owner_absent_since = "", 0, None
            return num_freed

    async def _owner_missing(self, now: float) -> bool:
        """Whether the owner has been out of the members bucket for a whole TTL, as seen so far
        (while draining: whether it is out now)."""
        try:
            schedulers = await live_members(self.bus, self.subjects.members_bucket, MemberKind.SCHEDULER)
        except Exception as exc:  # a NATS hiccup is no proof of death
            log.debug("membership check failed: %r", exc)
            return False
        if any(m.member_id == self.owner for m in schedulers):
            self._owner_absent_since = None
            return False
        if self._owner_absent_since is None:
            self._owner_absent_since = now
        return self.draining or now - self._owner_absent_since >= MEMBER_TTL_S

    def _wake_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        """From a writer thread: a G3 write's event, or a handoff write's notice, waits to go."""
        with contextlib.suppress(RuntimeError):  # the loop closed (shutting down): nobody waits
            loop.call_soon_threadsafe(self._written.set)

    async def _publish_written(self, stop: asyncio.Event) -> None:
        """G3 writes end on the store's thread, between steps too: their events go out as soon as
        they are written (a P/D handoff waits for them), not with the next step or load report."""
        while not stop.is_set():
            await self._written.wait()  # (set at ``stop`` too)
            self._written.clear()  # before the drain: a write after it sets it again
            try:
                await self.publish_kv_events()
            except Exception as exc:  # the next notice or load report sends them
                log.warning("publishing kv events failed: %r", exc)

    async def _sweep_handoffs(self, handoff: HandoffArea, stop: asyncio.Event) -> None:
        """Collect handoff files nobody loaded or dropped, now and then (at start too: a worker
        that died may have left some)."""
        while not stop.is_set():
            try:
                num_deleted = await asyncio.to_thread(handoff.sweep)
                if num_deleted:
                    log.info("handoff area: %d stale files deleted", num_deleted)
            except OSError as exc:
                log.warning("handoff sweep failed: %r", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(SWEEP_MAX_S, handoff.max_age_s / 2))

    async def _report_load(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.drop_orphans()
            await self._publish_load()
            await self.publish_kv_events()  # G3 writes finish between steps too
            await self._publish_stats()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.load_interval_s)
