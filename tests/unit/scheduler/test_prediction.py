"""Predicted Outputs as a draft source in the scheduler core: where a prediction's draft starts
(aligned with the output, re-aligned after it departs and comes back), drafts without an
automatic method, and the accepted / rejected counts a request's usage reports."""

from __future__ import annotations

from array import array

from libs.protocol.codec import unpack_tokens
from libs.protocol.messages import SamplingParams, StructuredOutput, StructuredOutputKind
from services.scheduler.outputs import _take_output
from services.scheduler.sequence import Sequence
from services.scheduler.speculation import Speculator, prediction_start
from services.scheduler.worker_scheduler import Limits, WorkerScheduler

EOS = 2
PROMPT = [50, 51, 52]
PREDICTION = [10, 11, 12, 13, 14, 15, 16, 17]


def packed(tokens: list[int]) -> bytes:
    return array("I", tokens).tobytes()


def start(output_tail: list[int], hint: int = 0, prediction: list[int] = PREDICTION) -> int:
    return prediction_start(packed(prediction), packed(output_tail), hint)


def test_a_prediction_draft_starts_where_the_output_has_got_to() -> None:
    assert start([]) == 0 and start([], prediction=[]) == -1
    assert start([10, 11]) == 2
    assert start([99, 12, 13]) == 4  # "12 13" matched: the output departed before it
    assert start([11, 12, 99]) == -1  # nothing after 99 in the prediction
    assert start([16, 17]) == -1  # the prediction is used up
    # Byte matches across token boundaries are not token matches.
    assert start([0x0100], prediction=[0x0001_0000, 0x0000_0002, 0x0100, 7]) == 3


def test_a_repeated_line_keeps_the_alignment_that_the_hint_gives() -> None:
    prediction = [1, 2, 3, 9, 1, 2, 3, 8]  # "1 2 3" twice
    assert start([1, 2, 3], hint=0, prediction=prediction) == 3
    assert start([1, 2, 3], hint=4, prediction=prediction) == 7  # the second time round
    # A draft started at 3 and the output grew since: its tail ends past 3, even if the tokens
    # that ended there come again (a draft accepted whole up to a repeat).
    assert start([1, 2, 3], hint=3, prediction=prediction) == 7
    assert start([5, 1, 2, 3], hint=8, prediction=prediction) == 3  # none ends past the hint: from 0
    # one token is looked for from the hint only: a lone common token elsewhere aligns nothing
    assert start([7, 9], hint=4, prediction=prediction) == -1
    assert start([7, 1], hint=4, prediction=prediction) == 5


def core_with(method: str = "none", k: int = 3) -> WorkerScheduler:
    limits = Limits(32, 4, 4, 64, 256, 16, 0.0, speculative_method=method, num_speculative_tokens=k)
    return WorkerScheduler(limits)


def step(core: WorkerScheduler, sampled: list[int], expect_draft: list[int]) -> None:
    plan = core.schedule()
    drafts = [unpack_tokens(d) for d in plan.draft_token_ids] or [[]]
    assert drafts == [expect_draft]
    core.postprocess(("s",), sampled, num_sampled=[len(sampled)])
    core.check_integrity()


def test_a_prediction_drafts_without_a_method_and_counts_what_ended_in_the_output() -> None:
    core = core_with()
    params = SamplingParams(temperature=0.0, max_tokens=30)
    core.add(Sequence("s", "g", list(PROMPT), params, EOS, prediction_token_ids=list(PREDICTION)))
    seq = core.seqs["s"]
    step(core, [10], [])  # the prefill samples the first token: no draft for a prefill
    step(core, [11, 12, 13, 14], [11, 12, 13])  # all accepted, then the sample after them
    assert (seq.num_unsent_accepted_prediction_tokens, seq.num_unsent_rejected_prediction_tokens) == (3, 0)
    out = _take_output(seq, "")
    assert (out.num_accepted_prediction_tokens, out.num_rejected_prediction_tokens) == (3, 0)
    assert seq.num_unsent_accepted_prediction_tokens == seq.num_unsent_rejected_prediction_tokens == 0
    step(core, [99], [15, 16, 17])  # the output departs: all three rejected
    step(core, [40], [])  # nothing in the prediction follows 99: an undrafted decode
    assert seq.output_token_ids == [10, 11, 12, 13, 14, 99, 40]
    assert (seq.num_unsent_accepted_prediction_tokens, seq.num_unsent_rejected_prediction_tokens) == (0, 3)
    stats = core.speculator.stats
    assert (stats["prediction"].num_drafted, stats["prediction"].num_accepted) == (6, 3)
    assert stats["ngram"].num_verified == 0


def test_a_stop_inside_an_accepted_prediction_counts_only_what_was_output() -> None:
    core = core_with()
    params = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(12,))
    core.add(Sequence("s", "g", list(PROMPT), params, EOS, prediction_token_ids=list(PREDICTION)))
    seq = core.seqs["s"]
    step(core, [10], [])
    step(core, [11, 12, 13, 14], [11, 12, 13])  # 12 is a stop: 13 and 14 never reach the output
    assert seq.is_finished and seq.output_token_ids == [10, 11, 12]
    assert (seq.num_unsent_accepted_prediction_tokens, seq.num_unsent_rejected_prediction_tokens) == (2, 1)


def test_a_prediction_goes_first_then_ngram_for_any_sequence() -> None:
    speculator = Speculator("ngram")
    params = SamplingParams(max_tokens=50)
    seq = Sequence("s", "g", [1, 2, 3, 1, 2], params, EOS, prediction_token_ids=[7, 8, 9])
    assert speculator.draft_for(seq, 2, 100) == [7, 8] and seq.draft_source == "prediction"
    seq.output_token_ids = [6]  # not in the prediction: the n-gram source drafts instead
    assert speculator.draft_for(seq, 2, 100) == [] and speculator.may_overlap(seq)
    seq.output_token_ids = [6, 1, 2]  # "1 2" came before, followed by "6 1" most recently
    assert speculator.draft_for(seq, 2, 100) == [6, 1] and seq.draft_source == "ngram"
    constrained = SamplingParams(max_tokens=50, structured_output=StructuredOutput(StructuredOutputKind.JSON))
    grammar = Sequence("j", "g", [1], constrained, EOS, prediction_token_ids=[7, 8, 9])
    # A constrained one too: the worker cuts its draft to what its grammar accepts.
    assert speculator.draft_for(grammar, 2, 100) == [7, 8] and not speculator.may_overlap(grammar)
    speculator.check_integrity({"s", "j"})
    speculator.forget("s")
    speculator.forget("j")
    speculator.check_integrity(set())


def test_choices_share_the_prediction() -> None:
    seq = Sequence("r", "g", [1], SamplingParams(n=2), EOS, prediction_token_ids=[7, 8])
    assert seq.choice(1).prediction_token_ids == [7, 8]
