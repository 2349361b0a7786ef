"""ModelRunner, the step driver: the worker's sequences, and one forward + sample per SchedulerOutput.

The forward itself, the KV pages and the attention backend are the ForwardExecutor's; the runner
turns a plan into a ForwardBatch and the logits into sampled tokens.

The scheduler decides everything about KV placement: a plan names, for each sequence, the pages
to append to its block table and how many tokens to compute after those already computed. The
runner lays the step out flat (rows with several tokens first, then single-token rows, as the
attention backend wants), runs the model once, and samples for the rows whose computed tokens
reach the end of what they know: a prefill's last chunk, or a decode.

With KV tiers (``kv_tiers``) and a handoff area, a plan's saves are copied out first, before
anything in the step can overwrite a freed page, then new sequences' ``kv_load`` blocks are filled
from G2 / G3 and the handoff area (``KVTransfer``). A block that cannot be filled is recomputed in
this same forward with every block after it: its row starts earlier and computes more tokens, and
ends where the plan said.

One bad sequence fails alone (``failed_seq_ids``): a new one whose tokens the model cannot take
is refused before the step, a row whose logits are not finite samples nothing, and a forward that
raises is rerun row by row (a rerun rewrites the same KV slots) so only the rows that raise alone
fail. The worker drops a failed sequence at once and skips it in plans made before the scheduler
knew (overlap), until a plan's ``finished_seq_ids`` names it. Only a forward that fails every row
alone (the model itself is broken), or a ``PlanError``, fails the whole step (see row_isolation).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import replace

import torch

from libs.protocol.codec import pack_tokens, unpack_tokens
from libs.protocol.kv_messages import KVLoad
from libs.protocol.messages import Logprobs, ModelRunnerOutput, NewSequence, SchedulerOutput
from services.worker.forward_executor import CausalLM as CausalLM  # re-exported: callers import it here
from services.worker.forward_executor import Executor, ForwardExecutor
from services.worker.forward_executor import ModelShape as ModelShape  # re-exported
from services.worker.grammar import SequenceGrammar
from services.worker.grammar_compilers import Grammars
from services.worker.handoff_area import HandoffArea
from services.worker.image_inputs import ImageInputs
from services.worker.kv_cache import KVBlocks
from services.worker.kv_tiers import KVTiers, LoadResult
from services.worker.kv_transfer import KVTransfer
from services.worker.mask_job import MaskJob, MaskResult
from services.worker.mtp_drafter import MTPDrafter
from services.worker.row_isolation import PlanError as PlanError  # re-exported: callers import it here
from services.worker.row_isolation import drop_non_finite, forward_isolating, kept_mask
from services.worker.sampler import GrammarMask, Sampler, SamplingState
from services.worker.sequence_state import SequenceState, input_error
from services.worker.step_rows import (
    NO_SAMPLES,
    Sampled,
    StepRow,
    drafter_rows,
    forward_batch,
    mask_requests,
    with_drafts,
)
from services.worker.verify import num_accepted, positions

log = logging.getLogger(__name__)

# A step of one row that raises is blamed on its sequence; this many such steps in a row, and the
# next one fails the step instead (the model itself is broken: the worker drops everything).
MAX_LONE_FAILURES = 3


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        shape: ModelShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        grammars: Grammars | None = None,
        kv_tiers: KVTiers | None = None,
        handoff: HandoffArea | None = None,
        drafter: MTPDrafter | None = None,
        batch_invariant: bool = False,
        one_thread_max_tokens: int = 0,
        executor: Executor | None = None,
        images: ImageInputs | None = None,
    ) -> None:
        """``executor``: runs the forwards instead of a ForwardExecutor built here from the model
        (a tensor-parallel worker's ParallelExecutor); ``images``: a vision model's image inputs."""
        self.executor: Executor = executor or ForwardExecutor(
            model,
            shape,
            num_blocks,
            block_size,
            dtype,
            device,
            batch_invariant,
            one_thread_max_tokens=one_thread_max_tokens,
        )
        self.drafter = drafter  # None: drafts come only from the scheduler
        self.shape = shape
        self.device = self.executor.device
        self.sampler = Sampler()
        self.seqs: dict[str, SequenceState] = {}
        # Failed and dropped here, not yet in a plan's finished_seq_ids: plans made before the
        # scheduler heard of the failure (overlap) may still schedule them, and skip them here.
        self.failed_seq_ids: set[str] = set()
        # Per failed sequence, the blocks it held: plans made before the scheduler knew of the
        # failure may still ask to save them, and their KV was never (or badly) written.
        self._unwritten: dict[str, list[int]] = {}
        self._num_lone_failures = 0  # steps in a row whose one row raised
        self.grammars = grammars if grammars is not None else Grammars(None)
        self._masks: MaskJob | None = None  # made on the first constrained step
        self.kv_tiers = kv_tiers  # None: no G2 / G3; a plan's loads are all recomputed
        self.transfer = KVTransfer(self.kv_cache, kv_tiers, handoff)
        self.images = images

    @property
    def kv_cache(self) -> KVBlocks:
        return self.executor.kv_cache

    @property
    def num_running_seqs(self) -> int:
        return len(self.seqs)

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        # Read before this plan's finished ids release them: a plan made after the scheduler heard
        # of a failure may still carry a save it queued earlier, or a new row that hit the blocks.
        unwritten = {b for blocks in self._unwritten.values() for b in blocks}
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
            self.failed_seq_ids.discard(seq_id)
            self._unwritten.pop(seq_id, None)
        self.transfer.save(plan, unwritten)
        rows: list[StepRow] = []
        loads: dict[str, LoadResult] = {}
        failed: dict[str, str] = {}  # seq_id -> why it cannot go on: dropped after the step
        for new in plan.new_seqs:
            row = self._add(new, failed)
            if row is None:
                continue
            if new.kv_load is not None:
                row, loads[new.seq_id] = self._load(row, new.kv_load)
            rows.append(self._recompute_unwritten(row, unwritten))
        rows += self._held_rows(plan)
        for row in rows:
            self._check_row(row)
        if self.images is not None:  # read before the forward: a missing one fails its row alone
            rows = self.images.load(rows, failed)
        started = time.perf_counter()
        sampled = self._run(rows, failed) if rows else NO_SAMPLES
        forward_time_s = time.perf_counter() - started if rows else 0.0
        self._drop(failed)
        failed.update(sampled.failed)
        logprobs = sampled.logprobs
        counts = [len(tokens) for tokens in sampled.token_ids]
        drafts = sampled.drafts
        return ModelRunnerOutput(
            step_id=plan.step_id,
            seq_ids=tuple(r.state.seq_id for r in sampled.rows),
            sampled_token_ids=pack_tokens([t for tokens in sampled.token_ids for t in tokens]),
            num_running_seqs=self.num_running_seqs,
            logprobs=tuple(logprobs) if any(lp is not None for lp in logprobs) else (),
            failed_seq_ids=tuple(failed),
            failed_errors=tuple(failed.values()),
            num_loaded_host_blocks=sum(r.num_host_blocks for r in loads.values()),
            num_loaded_store_blocks=sum(r.num_store_blocks for r in loads.values()),
            num_failed_load_blocks=sum(r.num_failed_blocks for r in loads.values()),
            num_loaded_partial_blocks=sum(r.num_partial_blocks for r in loads.values()),
            num_failed_partial_blocks=sum(r.num_failed_partial_blocks for r in loads.values()),
            failed_load_seq_ids=tuple(seq_id for seq_id, r in loads.items() if r.num_failed_blocks),
            failed_load_num_blocks=tuple(r.num_failed_blocks for r in loads.values() if r.num_failed_blocks),
            num_sampled_tokens=pack_tokens(counts) if any(n != 1 for n in counts) else b"",
            forward_time_s=forward_time_s,
            draft_token_ids=pack_tokens([token_id for token_id, _ in drafts]) if drafts else b"",
            draft_probs=tuple(p for _, p in drafts),
        )

    def prefetch(self, plan: SchedulerOutput) -> None:
        """Start reading the plan's G3 loads now, before its turn (any thread; cheap)."""
        if self.kv_tiers is not None:
            self.kv_tiers.prefetch(plan)

    def _load(self, row: StepRow, load: KVLoad) -> tuple[StepRow, LoadResult]:
        """Fill the row's loaded blocks; if only some load, the row starts at the first that did not."""
        state = row.state
        restart, loaded = self.transfer.load(state.seq_id, state.block_table, state.num_computed_tokens, load)
        num_recomputed = state.num_computed_tokens - restart
        state.num_computed_tokens = restart
        return StepRow(state, row.num_tokens + num_recomputed), loaded

    def _add(self, new: NewSequence, failed: dict[str, str]) -> StepRow | None:
        """Hold a new sequence; one the model cannot take goes to ``failed`` instead, unheld."""
        prompt = unpack_tokens(new.prompt_token_ids)
        block_table = unpack_tokens(new.block_ids)
        self._check_blocks(new.seq_id, block_table)
        state = SequenceState(
            seq_id=new.seq_id,
            token_ids=prompt + unpack_tokens(new.output_token_ids),
            num_prompt_tokens=len(prompt),
            sampling_params=new.sampling_params,
            stop_token_ids=frozenset(new.stop_token_ids),
            block_table=block_table,
            num_computed_tokens=new.num_computed_tokens,
            image_spans=new.image_spans,
        )
        self.failed_seq_ids.discard(new.seq_id)  # the scheduler sends it whole: it knows best
        why = input_error(state, self.shape.vocab_size, self.shape.max_num_tokens) or self._image_error(state)
        if why is not None:
            failed[new.seq_id] = why
            # What it shares (a prefix hit, choice 0's prompt) others computed; the rest is unwritten.
            self._unwritten[new.seq_id] = block_table[new.num_computed_tokens // self.block_size :]
            return None
        constraint = new.sampling_params.structured_output
        if constraint is not None:
            # Compiling starts now, on a helper thread, and overlaps this step's prefill.
            compiled = self.grammars.submit(constraint)
            state.grammar = SequenceGrammar(constraint, compiled, new.stop_token_ids, self.grammars.alphabet)
            for token_id in state.output_token_ids:  # a resumed sequence replays its outputs
                state.grammar.accept(token_id)
        self.seqs[new.seq_id] = state
        return StepRow(state, new.num_scheduled_tokens)

    def _image_error(self, state: SequenceState) -> str | None:
        return "this worker's model takes no images" if state.image_spans and self.images is None else None

    def _recompute_unwritten(self, row: StepRow, unwritten: set[int]) -> StepRow:
        """A new row whose cached prefix holds a block a failed sequence never wrote (overlap: a
        plan made before the failure was known found it in the prefix cache) computes again from
        that block on, rewriting it with this row's identical tokens."""
        state = row.state
        num_cached_blocks = state.num_computed_tokens // self.block_size
        bad = [i for i, b in enumerate(state.block_table[:num_cached_blocks]) if b in unwritten]
        if not bad:
            return row
        restart = bad[0] * self.block_size
        log.warning("%s: its cached prefix came from a failed sequence: recomputed", state.seq_id)
        num_recomputed = state.num_computed_tokens - restart
        state.num_computed_tokens = restart
        return StepRow(state, row.num_tokens + num_recomputed)

    def _held_rows(self, plan: SchedulerOutput) -> list[StepRow]:
        """The plan's rows of sequences held here, their new blocks appended to their tables."""
        counts = unpack_tokens(plan.num_scheduled_tokens)
        if not len(counts) == len(plan.seq_ids) == len(plan.new_block_ids):
            raise PlanError("seq_ids, num_scheduled_tokens and new_block_ids differ in length")
        drafts = plan.draft_token_ids or (b"",) * len(plan.seq_ids)
        if len(drafts) != len(plan.seq_ids):
            raise PlanError("seq_ids and draft_token_ids differ in length")
        rows: list[StepRow] = []
        for seq_id, num_tokens, blocks, draft in zip(
            plan.seq_ids, counts, plan.new_block_ids, drafts, strict=True
        ):
            state = self.seqs.get(seq_id)
            if state is None and seq_id in self.failed_seq_ids:
                # failed in an earlier step, planned before the scheduler knew
                self._unwritten[seq_id] += unpack_tokens(blocks)
                continue
            if state is None:
                raise PlanError(f"sequence {seq_id!r} is not held here")
            new_blocks = unpack_tokens(blocks)
            self._check_blocks(seq_id, new_blocks)
            state.block_table += new_blocks
            rows.append(with_drafts(StepRow(state, num_tokens), unpack_tokens(draft), self.shape.vocab_size))
        return rows

    def _drop(self, failed: dict[str, str]) -> None:
        """Forget the sequences that failed this step; their blocks are the scheduler's to free."""
        for seq_id, why in failed.items():
            log.warning("sequence %s failed: %s", seq_id, why)
            state = self.seqs.pop(seq_id, None)
            self.failed_seq_ids.add(seq_id)
            if state is not None:
                self._unwritten[seq_id] = state.block_table

    def _check_row(self, row: StepRow) -> None:
        state, end = row.state, row.state.num_computed_tokens + row.num_tokens
        if row.num_tokens <= 0 or end > state.num_tokens:
            raise PlanError(
                f"{state.seq_id}: {row.num_tokens} tokens after {state.num_computed_tokens} "
                f"of {state.num_tokens}"
            )
        if len(state.block_table) * self.block_size < end:
            raise PlanError(f"{state.seq_id}: block table too short for {end} tokens")

    def _check_blocks(self, seq_id: str, block_ids: list[int]) -> None:
        """Only the ids a plan adds: those already in a table were checked when they came."""
        if max(block_ids, default=0) >= self.kv_cache.num_blocks:
            raise PlanError(f"{seq_id}: block id beyond the pool")

    def _run(self, rows: list[StepRow], failed: dict[str, str]) -> Sampled:
        """Forward, sample, and draft for the next step if a drafter is set; a row that fails goes
        to ``failed`` and samples nothing."""
        # Multi-token rows (prefill chunks, drafted decodes) first, then single-token rows
        # (decodes): the layout the attention backends batch on. Sorting is stable, so plan order
        # is kept within each.
        rows = sorted(rows, key=lambda r: r.num_tokens == 1)
        starts = [row.state.num_computed_tokens for row in rows]
        ran, sampled = self._forward_and_sample(rows, failed)
        hidden = self.executor.last_hidden
        if self.drafter is None or ran is not rows or hidden is None:
            return sampled  # (rows rerun one by one: the last forward's hidden is one row's)
        mtp_rows = drafter_rows(rows, starts, sampled, failed)
        try:
            return replace(sampled, drafts=self.drafter.draft(mtp_rows, hidden)) if mtp_rows else sampled
        except Exception:  # a draft is optional: the step's samples stand without one
            log.exception("the MTP drafter failed: this step drafts nothing")
            return sampled

    def _forward_and_sample(
        self, rows: list[StepRow], failed: dict[str, str]
    ) -> tuple[list[StepRow], Sampled]:
        """``_run`` without drafting; also returns the rows that ran (``rows`` itself when one
        forward ran them all)."""
        sampling = [row for row in rows if row.samples]
        # One logits row per sampled position: at[p] = (sampling row j, its i-th position)
        at = [(j, i) for j, row in enumerate(sampling) for i in range(row.num_samples)]
        masks = self._start_masks(sampling)  # filled while the forward runs
        try:
            blame = self._num_lone_failures < MAX_LONE_FAILURES
            ran, logits = forward_isolating(self._forward, rows, failed, blame_lone_row=blame)
            self._num_lone_failures = self._num_lone_failures + 1 if len(rows) == 1 and not ran else 0
        finally:
            mask = masks.result() if masks is not None else None  # the job never outlives its step
        for row in ran:
            row.state.num_computed_tokens += row.num_tokens
        # keep[k]: the position whose logits are logits[k] (the positions of rows that ran, in order)
        keep = [p for p, (j, _) in enumerate(at) if sampling[j].state.seq_id not in failed]
        if logits is None or not keep:
            return ran, NO_SAMPLES
        logits, keep = drop_non_finite(logits, keep, lambda p: sampling[at[p][0]].state.seq_id, failed)
        whole = [k for k, p in enumerate(keep) if sampling[at[p][0]].state.seq_id not in failed]
        if not whole:
            return ran, NO_SAMPLES
        if len(whole) < len(keep):  # a drafted row with some non-finite positions fails whole
            logits, keep = logits[whole], [keep[k] for k in whole]
        kept_rows = [sampling[at[p][0]] for p in keep if at[p][1] == 0]
        return ran, self._sample(kept_rows, logits, kept_mask(mask, keep))

    def _sample(
        self, rows: list[StepRow], logits: torch.Tensor, mask: tuple[GrammarMask | None, dict[int, str]]
    ) -> Sampled:
        """``logits``: one row per sampled position of ``rows``, in order; ``mask``'s indices are
        positions too (a failed grammar's: its row's first)."""
        grammar_mask, grammar_failed = mask
        views: list[SamplingState] = []
        for row in rows:
            views += positions(row.state, row.num_drafts) if row.num_drafts else [row.state]
        out = self.sampler(logits, views, grammar_mask)
        token_ids: list[list[int]] = []
        logprobs: list[Logprobs | None] = []
        failed: dict[str, str] = {}
        place = 0  # this row's first position in ``out``
        for row in rows:
            state, num_drafts = row.state, row.num_drafts
            samples = out.token_ids[place : place + 1 + num_drafts]
            num_kept = 1 + (num_accepted(state.token_ids[-num_drafts:], samples) if num_drafts else 0)
            if place in grammar_failed:
                failed[state.seq_id] = grammar_failed[place]
                state.grammar = None
                # A stop token keeps the worker in step with plans already in flight for it.
                samples, num_kept = [min(state.stop_token_ids, default=samples[0])], 1
            if num_drafts:  # the rejected drafts leave its tokens, and their KV counts no more
                del state.token_ids[-num_drafts:]
                state.num_computed_tokens -= num_drafts - (num_kept - 1)
            state.token_ids += samples[:num_kept]
            if state.grammar is not None:
                for token_id in samples[:num_kept]:
                    state.grammar.accept(token_id)
            token_ids.append(samples[:num_kept])
            parts = [lp for lp in out.logprobs[place : place + num_kept] if lp is not None]
            logprobs.append(Logprobs.concat(parts))
            place += 1 + num_drafts
        return Sampled(rows, token_ids, logprobs, failed)

    def _forward(self, rows: list[StepRow]) -> torch.Tensor | None:
        """One forward over ``rows``, writing their KV and advancing nothing: the logits of the
        rows that sample, [num_sampling, vocab] float32, or None when none does."""
        images = self.images.gather(rows) if self.images is not None else None
        return self.executor.forward(forward_batch(rows, images))

    def _start_masks(self, sampling: list[StepRow]) -> Future[MaskResult] | None:
        """The masks of the sampled positions of ``sampling``'s constrained rows, being filled."""
        requests = mask_requests(sampling)
        if not requests:
            return None
        if self._masks is None:
            self._masks = MaskJob(self.grammars.vocab_size)
        return self._masks.start(requests)

    def reset(self) -> None:
        """Drop every sequence: after a failed step (the scheduler fails them all), or when the
        owner is gone (every sequence here is the owner's)."""
        self.seqs.clear()
        self.failed_seq_ids.clear()
        self._unwritten.clear()
        self._num_lone_failures = 0

    def check_integrity(self) -> None:
        assert not self.failed_seq_ids & self.seqs.keys(), "a failed sequence is still held"
        assert self._unwritten.keys() <= self.failed_seq_ids, "unwritten blocks of a live sequence"
        for state in self.seqs.values():
            assert state.num_computed_tokens <= state.num_tokens
            assert len(state.block_table) * self.block_size >= state.num_computed_tokens
            assert all(0 <= b < self.kv_cache.num_blocks for b in state.block_table)
