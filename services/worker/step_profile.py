"""Step times measured at start, before the worker announces itself.

A few synthetic plans run through the real ModelRunner: decodes of one row and of several rows,
alone and verifying drafts of each of DRAFT_LENGTHS, so that the steps' token counts double from
one to 64 (8 rows): the knots of the scheduler's piecewise-linear step-time model, whose cost per
token changes with the size (on a CPU a step is flat up to a few tokens and then is not).
Their times (``StepSample``) go out with the worker's load reports, and the scheduler's
speculative policy fits its step-time model to them (services/scheduler/spec_policy.py) before
any request has run, instead of starting from guesses.
Each shape runs once to warm up, then RUNS_TIMED times, and the fastest counts: a shape's first
forward is slow (allocations, kernel choice), running it here also spares the first requests that
cost, and one slow step (a busy neighbour only ever adds time) must not become a row the fit
never forgets.

The synthetic sequences use pages from the start of the pool and are dropped afterwards; the
scheduler has handed out no page yet, and a page's content means nothing until a plan writes it.
"""

from __future__ import annotations

import logging
import math

from libs.protocol.codec import pack_tokens
from libs.protocol.member_messages import StepSample
from libs.protocol.messages import ModelRunnerOutput, NewSequence, SamplingParams, SchedulerOutput
from services.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)

CONTEXT_LEN = 16  # tokens each synthetic sequence holds before its decodes (at most): a short
# prefill keeps the profile cheap; attention over longer contexts is what live steps teach the fit
MAX_ROWS = 8  # rows of the batched shapes (fewer if the worker runs fewer sequences)
DRAFT_LENGTHS = (1, 3, 7)  # drafted tokens per verifying row: 2, 4 and 8 tokens a row
RUNS_TIMED = 2  # runs of each shape after its warm-up; the fastest is the sample
PARAMS = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


def profile_steps(runner: ModelRunner, max_num_seqs: int) -> tuple[StepSample, ...]:
    """Time decodes of 1 row, then of ``min(MAX_ROWS, max_num_seqs)`` rows (fewer if the pool
    holds fewer), without drafts and verifying a draft of each of ``DRAFT_LENGTHS``. Returns ()
    when the pool or the model's positions cannot hold one synthetic sequence, or when a step
    fails. The runner holds no sequence afterwards."""
    # Each draft length starts the sequences again after their context (the first prefills it;
    # the others find it cached, as a prefix hit would): the first sequence decodes at one row and
    # at all rows, 1 + RUNS_TIMED times each, every token and draft computed in the worst case
    # (all drafts accepted). The context shrinks to fit a model of few positions, the rows to fit
    # a small pool.
    num_decoded = 1 + 2 * (1 + RUNS_TIMED) * (1 + max(DRAFT_LENGTHS))
    max_position = min(runner.shape.max_num_tokens, runner.kv_cache.num_blocks * runner.block_size)
    context_len = min(CONTEXT_LEN, max_position - num_decoded)
    if context_len < 1:
        return ()
    blocks_per_seq = math.ceil((context_len + num_decoded) / runner.block_size)
    num_rows = min(MAX_ROWS, max_num_seqs, runner.kv_cache.num_blocks // blocks_per_seq)
    if num_rows < 1:
        return ()
    seq_ids = [f"step-profile-{i}" for i in range(num_rows)]
    samples: list[StepSample] = []
    try:
        for draft_len in (0, *DRAFT_LENGTHS):
            num_cached = 0 if draft_len == 0 else context_len - 1
            new_seqs = _sequences(runner, seq_ids, context_len, blocks_per_seq, num_cached)
            checked(runner.execute(SchedulerOutput(step_id=0, new_seqs=new_seqs)), num_rows)
            for rows in sorted({1, num_rows}):
                _decode(runner, seq_ids[:rows], draft_len)  # warm-up
                seconds = min(_decode(runner, seq_ids[:rows], draft_len) for _ in range(RUNS_TIMED))
                samples.append(
                    StepSample(rows * (1 + draft_len), rows * draft_len, rows * bool(draft_len), seconds)
                )
            runner.reset()
    except Exception:  # the profile is optional: without it the policy starts from its priors
        log.exception("the step profile failed: the speculative policy starts from its priors")
        return ()
    finally:
        runner.reset()
    log.info(
        "step profile: %s",
        ", ".join(f"{s.num_tokens}/{s.num_draft_rows} {s.seconds * 1e3:.1f} ms" for s in samples),
    )
    return tuple(samples)


def _sequences(
    runner: ModelRunner, seq_ids: list[str], context_len: int, blocks_per_seq: int, num_cached: int
) -> tuple[NewSequence, ...]:
    """The synthetic sequences, each on pages of its own from the pool's start, with
    ``num_cached`` of their ``context_len`` tokens already computed."""
    return tuple(
        synthetic_sequence(
            runner, seq_id, 7 * i + 1, context_len, PARAMS, i * blocks_per_seq, blocks_per_seq, num_cached
        )
        for i, seq_id in enumerate(seq_ids)
    )


def synthetic_sequence(
    runner: ModelRunner,
    seq_id: str,
    seed: int,
    prompt_len: int,
    params: SamplingParams,
    first_block: int,
    num_blocks: int,
    num_cached: int = 0,
) -> NewSequence:
    """A made-up prompt of ``prompt_len`` token ids (varied by ``seed``) on the pool's pages
    ``first_block`` onwards, ``num_cached`` of its tokens already computed."""
    vocab_size = runner.shape.vocab_size
    return NewSequence(
        seq_id=seq_id,
        prompt_token_ids=pack_tokens([(seed + 13 * j) % vocab_size for j in range(prompt_len)]),
        output_token_ids=b"",
        sampling_params=params,
        stop_token_ids=(),
        block_ids=pack_tokens(range(first_block, first_block + num_blocks)),
        num_computed_tokens=num_cached,
        num_scheduled_tokens=prompt_len - num_cached,
    )


def _decode(runner: ModelRunner, seq_ids: list[str], draft_len: int) -> float:
    """One decode step of ``seq_ids``, each verifying ``draft_len`` arbitrary tokens: its time."""
    vocab_size = runner.shape.vocab_size
    draft = pack_tokens([(31 * j + 5) % vocab_size for j in range(draft_len)]) if draft_len else b""
    out = runner.execute(
        SchedulerOutput(
            step_id=0,
            seq_ids=tuple(seq_ids),
            num_scheduled_tokens=pack_tokens([1] * len(seq_ids)),
            new_block_ids=(b"",) * len(seq_ids),
            draft_token_ids=(draft,) * len(seq_ids) if draft_len else (),
        )
    )
    return checked(out, len(seq_ids)).forward_time_s


def checked(out: ModelRunnerOutput, num_rows: int) -> ModelRunnerOutput:
    """``out``, if every row ran and sampled: a step that dropped one is no measurement."""
    if out.error or out.failed_seq_ids or len(out.seq_ids) != num_rows:
        raise RuntimeError(f"a synthetic step failed: {out.error or out.failed_errors}")
    return out
