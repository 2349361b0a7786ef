"""The scheduler core and a ModelRunner in one process, with no bus: the baseline that measures
what the services cost, and the harness for engine tests.

With ``overlap`` the loop makes plan N+1 before it postprocesses result N, exactly as the
scheduler service does with two plans in flight (the runner executes plans in order): both take
their send/wait decisions from ``WorkerScheduler.next_plan``.

Lower KV tiers: plans carry the core's saves (store points) to the runner, and results report
loads back. The runner's tier events take the place of the bus: its G2 changes go to the core
(``note_host_blocks``), and the blocks it wrote to G3 are remembered here and looked up when a
request is added, as the kvcache service answers the scheduler service.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Protocol

from libs.protocol.codec import unpack_tokens
from libs.protocol.kv_messages import CacheTier, KVEvent, split_hashes
from libs.protocol.member_messages import StepSample
from libs.protocol.messages import FinishReason, ModelRunnerOutput, SamplingParams, SchedulerOutput
from services.scheduler.sequence import Sequence
from services.scheduler.worker_scheduler import Limits, WorkerScheduler


class Runner(Protocol):
    """What the engine needs of a worker: services.worker.model_runner.ModelRunner, or a fake."""

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput: ...

    def check_integrity(self) -> None: ...


class LocalEngine:
    def __init__(
        self,
        runner: Runner,
        limits: Limits,
        eos_token_id: int,
        overlap: bool = False,
        check: bool = False,
        step_profile: tuple[StepSample, ...] = (),
    ) -> None:
        self.runner = runner
        self.core = WorkerScheduler(limits)
        # the worker's start-up step times (services/worker/step_profile.py), as the scheduler
        # service passes them on from its load report
        self.core.record_step_profile(step_profile)
        self.eos_token_id = eos_token_id
        self.max_in_flight = 2 if overlap else 1
        self.check = check  # check_integrity after every step (tests)
        self.outputs: dict[str, list[int]] = {}  # seq id -> tokens, once finished
        self.finish_reasons: dict[str, FinishReason] = {}
        self.finished: dict[str, Sequence] = {}  # seq id -> the sequence (usage, logprobs)
        self.num_steps = 0
        self.num_preemptions = 0  # over finished sequences
        self._in_flight: deque[ModelRunnerOutput] = deque()
        self.stored_hashes: set[bytes] = set()  # blocks the runner wrote to G3

    def add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        priority: int = 0,
        tenant: str = "",
        prediction_token_ids: list[int] | None = None,
    ) -> list[Sequence]:
        """Queue a request; returns its choices (``params.n`` of them). ``prediction_token_ids``:
        the output it is expected to be (Predicted Outputs: a draft source)."""
        self.apply_tier_events()
        chain = self.core.kv_tiers.prompt_chain(list(prompt), tenant)
        num_stored = next((i for i, h in enumerate(chain) if h not in self.stored_hashes), len(chain))
        seq = Sequence(
            request_id,
            "",
            list(prompt),
            params,
            self.eos_token_id,
            priority=priority,
            tenant=tenant,
            num_stored_blocks=num_stored if self.core.kv_tiers.enabled else 0,
            block_hashes=list(chain),
            prediction_token_ids=list(prediction_token_ids or []),
        )
        return self.core.add(seq)

    def apply_tier_events(self) -> None:
        """What the runner's tiers did since the last call: G2 to the core, G3 to ``stored_hashes``."""
        tiers = getattr(self.runner, "kv_tiers", None)
        for event in tiers.drain_events() if tiers is not None else ():
            self._apply(event)

    def _apply(self, event: KVEvent) -> None:
        if event.tier is CacheTier.STORE:
            hashes = split_hashes(event.block_hashes)
            if event.stored:
                self.stored_hashes.update(hashes)
            else:
                self.stored_hashes.difference_update(hashes)
        else:
            self.core.kv_tiers.note_host_event(event)

    def abort(self, request_or_seq_id: str) -> list[Sequence]:
        """Finish a request, or one of its choices, as aborted; returns what was finished."""
        aborted = self.core.abort(request_or_seq_id)
        for seq in aborted:
            self._record(seq)
        if self.check:
            self.core.check_integrity()
        return aborted

    def has_work(self) -> bool:
        return self.core.has_work() or bool(self._in_flight)

    def step(self) -> None:
        """Send one plan (if there is work), then postprocess the oldest result when due.

        One StepLoop iteration, plus the wait its next one would do when this send filled the
        pipeline: the same sequence of sends and waits.
        """
        plan = self.core.next_plan(len(self._in_flight), self.max_in_flight)
        if plan is not None:
            self._in_flight.append(self.runner.execute(plan))
            self.apply_tier_events()
            self.num_steps += 1
            if self.check:
                self.core.check_integrity()
        if self._in_flight and (plan is None or len(self._in_flight) >= self.max_in_flight):
            result = self._in_flight.popleft()
            failed_loads = dict(zip(result.failed_load_seq_ids, result.failed_load_num_blocks, strict=True))
            num_host, num_store = result.num_loaded_host_blocks, result.num_loaded_store_blocks
            self.core.record_loads(result.step_id, num_host, num_store, failed_loads)
            self.core.record_step_time(result.step_id, result.forward_time_s)
            sampled = unpack_tokens(result.sampled_token_ids)
            failed = dict(zip(result.failed_seq_ids, result.failed_errors, strict=True))
            counts = unpack_tokens(result.num_sampled_tokens) if result.num_sampled_tokens else None
            changed = self.core.postprocess(
                result.seq_ids, sampled, result.logprobs, failed, counts, result.drafts()
            )
            for seq in changed:
                if seq.is_finished:
                    self._record(seq)
        if self.check:
            self.core.check_integrity()
            self.runner.check_integrity()

    def run(
        self, arrivals: Iterable[tuple[int, str, list[int], SamplingParams]] = ()
    ) -> dict[str, list[int]]:
        """Step until idle; ``arrivals`` are (step, request id, prompt, params) added at that step."""
        pending = sorted(arrivals, key=lambda a: a[0])
        step = 0
        while pending or self.has_work():
            while pending and pending[0][0] <= step:
                _, request_id, prompt, params = pending.pop(0)
                self.add(request_id, prompt, params)
            self.step()
            step += 1
        return self.outputs

    def _record(self, seq: Sequence) -> None:
        self.outputs[seq.seq_id] = list(seq.output_token_ids)
        assert seq.finish_reason is not None
        self.finish_reasons[seq.seq_id] = seq.finish_reason
        self.finished[seq.seq_id] = seq
        self.num_preemptions += seq.num_preemptions
