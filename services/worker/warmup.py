"""Warm-up before the worker announces itself: one short request through every sampling path, so
the first real request pays for no first use (lazy allocations, a random generator's set-up, the
filters' and penalties' first kernels, a prefill long enough for the dense matmul path).

The step profile (step_profile.py) already runs greedy decodes of 1-8 rows with and without
drafts; this adds what it leaves cold: prompts of WARM_PROMPT_LENS tokens, and a sampled,
filtered, penalized and logprob-returning decode. Its sequences use pages from the start of the
pool and are dropped afterwards, as the profile's are.
"""

from __future__ import annotations

import logging
import math
import time

from libs.protocol.codec import pack_tokens
from libs.protocol.messages import SamplingParams, SchedulerOutput
from services.worker.model_runner import ModelRunner
from services.worker.step_profile import checked, synthetic_sequence

log = logging.getLogger(__name__)

# A chat prompt's size, and one past the int8 dense threshold (quant.INT8_FP32_DENSE_MIN_TOKENS).
WARM_PROMPT_LENS = (40, 160)
NUM_DECODES = 2
SAMPLED = SamplingParams(
    temperature=0.8,
    top_p=0.9,
    top_k=50,
    min_p=0.01,
    repetition_penalty=1.1,
    presence_penalty=0.1,
    frequency_penalty=0.1,
    max_tokens=1 << 20,
    ignore_eos=True,
    seed=0,
    logprobs=True,
    top_logprobs=2,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


def warm_up(runner: ModelRunner) -> None:
    """Run the warm-up sequences (those the pool and the model's positions can hold) and drop them;
    a failure is logged, not raised: warming is an optimization."""
    start = time.perf_counter()
    try:
        for prompt_len in WARM_PROMPT_LENS:
            for params in (GREEDY, SAMPLED):
                _one_sequence(runner, prompt_len, params)
    except Exception:
        log.exception("warm-up failed: the first requests may be slower")
    finally:
        runner.reset()
    log.info("warm-up took %.2f s", time.perf_counter() - start)


def _one_sequence(runner: ModelRunner, prompt_len: int, params: SamplingParams) -> None:
    num_blocks = math.ceil((prompt_len + NUM_DECODES + 1) / runner.block_size)
    if num_blocks > runner.kv_cache.num_blocks or prompt_len + NUM_DECODES >= runner.shape.max_num_tokens:
        return
    seq = synthetic_sequence(runner, "warm-up", 3, prompt_len, params, 0, num_blocks)
    checked(runner.execute(SchedulerOutput(step_id=0, new_seqs=(seq,))), 1)
    for _ in range(NUM_DECODES):
        plan = SchedulerOutput(
            step_id=0, seq_ids=("warm-up",), num_scheduled_tokens=pack_tokens([1]), new_block_ids=(b"",)
        )
        checked(runner.execute(plan), 1)
    runner.reset()
