"""Unseeded sampling with drafts keeps the target's distribution: a chi-square test through the
real ModelRunner with forced drafts, against the distribution a plain-torch reference gives
(temperature, top-k and top-p applied), with enough samples that a 5% skew would be caught.

Each of many copies of one sequence verifies the same two drafted tokens ``a b`` after its
prompt; what comes back is a prefix of autoregressive sampling: ``t1`` (and, when ``t1 == a``,
``t2``; when also ``t2 == b``, ``t3``). Its law must be p(t1), p(a) p(t2 | a), p(a) p(b | a)
p(t3 | a b): the categories below are those outcomes."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from libs.kernels.sampling import top_k_top_p_min_p_filter_ref
from libs.models.attention import SingleSequenceCausalAttention
from libs.models.llama import LlamaForCausalLM
from libs.protocol.codec import pack_tokens, unpack_tokens
from libs.protocol.messages import NewSequence, SamplingParams, SchedulerOutput
from services.worker.model_runner import ModelRunner, ModelShape
from services.worker.sampler import Sampler
from tests.tiny_models import TINY_LLAMA

# Untied, so the logits are a random projection and spread (tied, a random model all but repeats
# its last token): top-k 4 then leaves a few likely tokens at each position.
CONFIG = dataclasses.replace(TINY_LLAMA, tie_word_embeddings=False)
PROMPT = [5, 17, 33, 9, 61, 42]
PARAMS = SamplingParams(temperature=1.0, top_k=4, top_p=0.9, max_tokens=8)
NUM_SAMPLES = 80_000
BATCH = 4_000  # sequences per round (one KV block each)
Outcome = tuple[int, ...]


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG, dtype=torch.float32).eval()


@torch.inference_mode()
def processed(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    """The target's sampling distribution after ``tokens``: [vocab], temperature, top-k, top-p."""
    hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), SingleSequenceCausalAttention())
    logits = model.compute_logits(hidden[-1:]).float()
    p = PARAMS
    return top_k_top_p_min_p_filter_ref(
        logits,
        torch.tensor([p.temperature]),
        torch.tensor([p.top_k]),
        torch.tensor([p.top_p]),
        torch.tensor([0.0]),
    )[0]


def expected_law(model: LlamaForCausalLM, a: int, b: int) -> dict[Outcome, float]:
    law: dict[Outcome, float] = {}
    p1, p2, p3 = processed(model, PROMPT), processed(model, [*PROMPT, a]), processed(model, [*PROMPT, a, b])
    for t1 in torch.nonzero(p1).flatten().tolist():
        if t1 != a:
            law[(t1,)] = float(p1[t1])
    for t2 in torch.nonzero(p2).flatten().tolist():
        if t2 != b:
            law[(a, t2)] = float(p1[a] * p2[t2])
    for t3 in torch.nonzero(p3).flatten().tolist():
        law[(a, b, t3)] = float(p1[a] * p2[b] * p3[t3])
    return law


def observe(model: LlamaForCausalLM, a: int, b: int) -> dict[Outcome, int]:
    """Outcomes of NUM_SAMPLES copies: each prefills its prompt but the last token, then a plan
    runs that token with the drafts ``a b``."""
    runner = ModelRunner(model, ModelShape.of(CONFIG), BATCH, 16, torch.float32)
    runner.sampler = Sampler(seed=1234)  # the unseeded rows' generator: a fixed stream, so no flake
    counts: dict[Outcome, int] = {}
    step_id = 0
    for round_ in range(NUM_SAMPLES // BATCH):
        ids = [f"r{round_}.{i}" for i in range(BATCH)]
        new = tuple(
            NewSequence(seq_id, pack_tokens(PROMPT), b"", PARAMS, (), pack_tokens([i]), 0, len(PROMPT) - 1)
            for i, seq_id in enumerate(ids)
        )
        step_id += 1
        assert runner.execute(SchedulerOutput(step_id, new)).seq_ids == ()  # no sample yet
        step_id += 1
        result = runner.execute(
            SchedulerOutput(
                step_id,
                seq_ids=tuple(ids),
                num_scheduled_tokens=pack_tokens([1] * BATCH),
                new_block_ids=(b"",) * BATCH,
                draft_token_ids=(pack_tokens([a, b]),) * BATCH,
            )
        )
        tokens = unpack_tokens(result.sampled_token_ids)
        num_sampled = unpack_tokens(result.num_sampled_tokens) if result.num_sampled_tokens else [1] * BATCH
        place = 0
        for n in num_sampled:
            outcome = tuple(tokens[place : place + n])
            counts[outcome] = counts.get(outcome, 0) + 1
            place += n
        step_id += 1
        runner.execute(SchedulerOutput(step_id, finished_seq_ids=tuple(ids)))
    return counts


def chi_square(counts: dict[Outcome, int], law: dict[Outcome, float]) -> float:
    assert counts.keys() <= law.keys(), f"outcomes the target never gives: {counts.keys() - law.keys()}"
    total = sum(counts.values())
    return sum((counts.get(o, 0) - total * p) ** 2 / (total * p) for o, p in law.items())


def critical(df: int, z: float = 3.0902) -> float:
    """The chi-square quantile at 1 - 1e-3 (z: that normal quantile), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def skewed(law: dict[Outcome, float], where: Outcome, factor: float = 1.05) -> dict[Outcome, float]:
    """``law`` with the outcomes starting ``where`` made ``factor`` times likelier (renormalised)."""
    raised = {o: p * (factor if o[: len(where)] == where else 1.0) for o, p in law.items()}
    total = sum(raised.values())
    return {o: p / total for o, p in raised.items()}


@pytest.mark.parametrize("drafts", ["likely", "unlikely"])
def test_unseeded_sampling_with_drafts_has_the_targets_distribution(
    model: LlamaForCausalLM, drafts: str
) -> None:
    p1 = processed(model, PROMPT)
    order = p1.argsort(descending=True).tolist()
    a = order[0] if drafts == "likely" else order[2]  # a draft taken often, or now and then
    p2 = processed(model, [*PROMPT, a])
    b = int(p2.argmax())
    law = expected_law(model, a, b)
    counts = observe(model, a, b)
    # Both drafts were accepted at times and rejected at times: the test exercised verification.
    assert sum(n for o, n in counts.items() if len(o) == 3) > 0
    assert sum(n for o, n in counts.items() if len(o) == 1) > 0
    df = len(law) - 1
    assert chi_square(counts, law) < critical(df)
    if drafts == "likely":  # the same samples refute a law 5% off in how often the draft is taken
        assert chi_square(counts, skewed(law, (a,))) > critical(df)
