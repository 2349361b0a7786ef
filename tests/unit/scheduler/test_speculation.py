"""The scheduler core's side of speculative decoding: n-gram drafts, and how a result of 1..k+1
tokens is taken (accepted drafts count as computed, a stop inside them ends the sequence there,
a result that does not follow the draft fails the sequence alone); integrity after each step."""

from __future__ import annotations

from array import array

from libs.protocol.codec import pack_floats, pack_tokens, unpack_tokens
from libs.protocol.messages import (
    FinishReason,
    Logprobs,
    SamplingParams,
    StructuredOutput,
    StructuredOutputKind,
)
from services.scheduler.sequence import Sequence
from services.scheduler.spec_policy import match_bucket
from services.scheduler.speculation import (
    MAX_CANDIDATES,
    RETRY_AFTER,
    Speculator,
    ngram_draft,
    ngram_match,
)
from services.scheduler.worker_scheduler import Limits, WorkerScheduler

EOS = 2
PROMPT = [10, 11, 12, 13, 10, 11]  # "10 11" came before, followed by "12 13"


def test_ngram_draft_takes_the_longest_most_recent_match() -> None:
    assert ngram_draft(array("I", PROMPT), 3) == [12, 13, 10]
    assert ngram_draft(array("I", [1, 5, 2, 9, 5, 2, 8, 5, 2]), 2) == [8, 5]  # "5 2": the later
    assert ngram_draft(array("I", [7, 1, 2, 3, 9, 2, 3, 4, 1, 2, 3]), 2) == [9, 2]  # "1 2 3" beats "2 3"
    assert ngram_draft(array("I", [1, 2, 3, 4]), 3) == []
    # A match one period back in a repeating run drafts the run on, past the sequence's end.
    assert ngram_draft(array("I", PROMPT), 7) == [12, 13, 10, 11, 12, 13, 10]
    assert ngram_draft(array("I", [4, 7, 7, 7]), 5) == [7, 7, 7, 7, 7]
    # Byte matches across token boundaries are not token matches.
    assert ngram_draft(array("I", [0x0100, 0x0200, 0x0300, 0x0001, 0x0002, 0x0100, 0x0200]), 2) == [0x0300, 1]
    # (bytes 3..10 of this one read as the last two tokens)
    assert ngram_draft(array("I", [0x0300, 1, 2, 0x0100, 0x0200]), 2) == []


def test_a_match_is_measured_back_past_its_n_gram() -> None:
    copy = [7, 1, 2, 3, 4, 5, 6, 8, 9, 1, 2, 3, 4, 5, 6]  # "1 .. 6" repeats, after 7 and after 9
    assert ngram_match(array("I", copy)) == (7, 6)  # the 4-gram "3 4 5 6", and "1 2" before it
    assert ngram_match(array("I", [5, 1, 2, 9, 5, 1, 2])) == (3, 3)  # the 3-gram "5 1 2"
    # Repeating structure: lines "90 91 93 94 x 92" for x = 1, 2, 3, and a copy that has
    # written two of them and the third's start, whose 4-gram starts every line: the copy follows
    # the prompt's third line (its match runs back 16 tokens), not the most recent occurrence of
    # the 4-gram (the line it wrote last, whose match runs back 5).
    lines = [[90, 91, 93, 94, x, 92] for x in (1, 2, 3)]
    copy = [*lines[0], *lines[1], *lines[2], 80, *lines[0], *lines[1], 90, 91, 93, 94]
    assert ngram_match(array("I", copy)) == (16, 16)  # the prompt's 3
    run = [3] * 40
    assert ngram_match(array("I", run)) == (39, 32)  # at most MAX_MATCH_LEN

    # Only the 16 most recent occurrences are compared: a better match before them goes unseen.
    def with_recent(num: int) -> array[int]:
        return array("I", [50, 51, 1, 2, 3, 4, 60, *[70, 1, 2, 3, 4, 61] * num, 50, 51, 1, 2, 3, 4])

    assert ngram_match(with_recent(MAX_CANDIDATES - 1)) == (6, 6)
    tokens = with_recent(MAX_CANDIDATES)
    assert ngram_match(tokens) == (len(tokens) - 7, 4)
    assert [match_bucket(n) for n in (0, 1, 2, 4, 5, 8, 9, 16, 17, 32)] == [0, 1, 2, 4, 5, 5, 6, 6, 7, 7]
    # A prediction's alignment too, over the output only.
    speculator = Speculator("none")
    prediction = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    seq = Sequence("s", "g", [20, 21], SamplingParams(max_tokens=50), EOS, prediction_token_ids=prediction)
    seq.output_token_ids = [20, 21, 22, 23, 24, 25]
    assert speculator.draft_for(seq, 2, 100) == [26, 27] and seq.draft_match_len == 6
    other = Sequence("t", "g", [20, 21], SamplingParams(max_tokens=50), EOS, prediction_token_ids=prediction)
    other.output_token_ids = [99, 21, 22, 23, 24, 25]
    assert speculator.draft_for(other, 2, 100) == [26, 27] and other.draft_match_len == 5
    # (the prediction agrees with the prompt further back: that does not count)
    params = SamplingParams(max_tokens=50)
    third = Sequence("u", "g", [5, 9], params, EOS, prediction_token_ids=[9, *prediction])
    third.output_token_ids = [20, 21, 22, 23, 24, 25]
    assert speculator.draft_for(third, 2, 100) == [26, 27] and third.draft_match_len == 6
    speculator.forget("u")
    speculator.forget("s")
    speculator.forget("t")


def test_a_sequence_with_no_match_overlaps_then_retries() -> None:
    speculator = Speculator()
    seq = Sequence("s", "g", [1, 2, 3], SamplingParams(max_tokens=50), EOS)
    assert not speculator.may_overlap(seq)  # never tried: it waits, so the next plan can draft
    assert speculator.draft_for(seq, 4, 100) == []
    overlaps = []
    for _ in range(RETRY_AFTER + 1):
        overlaps.append(speculator.may_overlap(seq))
        speculator.overlapped("s")
    assert overlaps == [True] * RETRY_AFTER + [False]
    seq.output_token_ids = [1, 2]  # now "1 2" came before
    assert speculator.draft_for(seq, 4, 100) == [3, 1, 2, 3]  # (the run goes on)
    assert not speculator.may_overlap(seq)  # it drafts: it waits for its result
    constrained = StructuredOutput(StructuredOutputKind.JSON)  # drafts too: the worker cuts them
    grammar = Sequence(
        "j", "g", [1, 2, 9, 1, 2], SamplingParams(max_tokens=50, structured_output=constrained), EOS
    )
    assert not speculator.may_overlap(grammar) and speculator.draft_for(grammar, 4, 100) == [9, 1, 2, 9]
    speculator.forget("j")
    speculator.forget("s")
    speculator.check_integrity(set())


def core_with(k: int = 3) -> WorkerScheduler:
    return WorkerScheduler(
        Limits(32, 4, 4, 64, 256, 16, 0.0, speculative_method="ngram", num_speculative_tokens=k)
    )


def decode_once(core: WorkerScheduler, seq_id: str, token: int) -> None:
    plan = core.schedule()
    assert not plan.draft_token_ids or plan.draft_token_ids == (b"",) * len(plan.seq_ids)
    core.postprocess((seq_id,), [token])
    core.check_integrity()


def test_accepted_drafts_count_as_computed_and_a_stop_inside_them_ends_it() -> None:
    core = core_with()
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(13,))
    core.add(Sequence("s", "g", list(PROMPT), params, EOS))
    decode_once(core, "s", 12)  # the prefill's token: "11 12" came before, then "13 10 11"
    seq = core.seqs["s"]
    plan = core.schedule()
    (draft,) = [unpack_tokens(d) for d in plan.draft_token_ids]
    assert draft == [13, 10, 11] and seq.draft_token_ids == draft
    assert len(core.block_manager.block_tables["s"]) * 4 >= seq.num_computed_tokens + len(draft)
    assert core.schedule().num_scheduled_seqs == 0  # drafts in flight: in no later plan
    core.check_integrity()
    step_logprobs = Logprobs(
        pack_floats([-0.5, -0.25]), pack_tokens([13, 7, 10, 8]), pack_floats([-1, -2, -3, -4]), 2
    )
    changed = core.postprocess(("s",), [13, 10], (step_logprobs,), num_sampled=[2])  # 13 accepted: a stop
    assert changed == [seq] and seq.finish_reason is FinishReason.STOP and seq.output_token_ids == [12, 13]
    (kept,) = seq.unsent_logprobs  # the logprobs of the kept token only
    assert kept == Logprobs(pack_floats([-0.5]), pack_tokens([13, 7]), pack_floats([-1, -2]), 2)
    core.check_integrity()


def test_a_partly_accepted_draft_goes_on_from_the_right_place() -> None:
    core = core_with()
    core.add(Sequence("s", "g", list(PROMPT), SamplingParams(temperature=0.0, max_tokens=20), EOS))
    decode_once(core, "s", 12)
    seq = core.seqs["s"]
    computed = seq.num_computed_tokens
    core.schedule()  # drafts [13, 10, 11]
    core.postprocess(("s",), [13, 10, 99], num_sampled=[3])  # two accepted, then 99
    assert seq.output_token_ids == [12, 13, 10, 99]
    assert seq.num_computed_tokens == computed + 1 + 2  # its input token and the accepted drafts
    assert seq.num_tokens - seq.num_computed_tokens == 1  # 99 is the next input
    core.check_integrity()
    stats = core.speculator.stats["ngram"]
    assert stats.num_drafted == 3 and stats.num_accepted == 2 and stats.num_verified == 1


def test_a_result_that_does_not_follow_the_draft_fails_only_that_sequence() -> None:
    core = core_with()
    for seq_id in ("s", "t"):
        core.add(Sequence(seq_id, "g", list(PROMPT), SamplingParams(temperature=0.0, max_tokens=20), EOS))
    core.schedule()
    core.postprocess(("s", "t"), [12, 12])
    core.schedule()  # both draft [13, 10, 11]
    changed = core.postprocess(("s", "t"), [99, 10, 13, 10], num_sampled=[2, 2])
    finished = {s.seq_id: s.finish_reason for s in changed if s.is_finished}
    assert finished == {"s": FinishReason.ERROR}  # 99 is not its draft's first token
    assert core.seqs["t"].output_token_ids == [12, 13, 10]
    core.check_integrity()
