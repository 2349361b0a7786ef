"""The suffix source: continuations counted from finished outputs, drafts that follow the most
frequent one, the bound on the table, and the core drafting a request from another's output."""

from __future__ import annotations

from array import array

import pytest

from libs.protocol.codec import unpack_tokens
from libs.protocol.messages import SamplingParams
from services.scheduler.sequence import Sequence
from services.scheduler.suffix_index import SuffixIndex
from services.scheduler.worker_scheduler import Limits, WorkerScheduler

EOS = 2


def packed(tokens: list[int]) -> array[int]:
    return array("I", tokens)


def test_a_draft_follows_the_most_frequent_continuation_of_the_longest_context() -> None:
    index = SuffixIndex()
    index.add(packed([1, 2, 3, 4, 5, 6]), num_prompt_tokens=2)  # output 3 4 5 6 after prompt 1 2
    index.check_integrity()
    assert index.draft(packed([9, 2, 3]), 8) == ([4, 5, 6], 2)  # "2 3" then the output as written
    assert index.draft(packed([9, 1, 2]), 8) == ([3, 4, 5, 6], 2)  # the prompt leads in
    assert index.draft(packed([7, 8]), 8) == ([], 0)
    assert index.draft(packed([3, 4]), 1) == ([5], 2)
    # Another output went on differently after "3 4" twice: the majority drafts.
    for _ in range(2):
        index.add(packed([3, 4, 9, 9]), num_prompt_tokens=2)
    assert index.draft(packed([3, 4]), 2) == ([9, 9], 2)
    # The longest context decides: "2 3 4" was only ever followed by 5.
    assert index.draft(packed([2, 3, 4]), 2) == ([5, 6], 3)
    index.check_integrity()


def test_one_tenants_outputs_never_draft_for_another() -> None:
    index = SuffixIndex()
    index.add(packed([1, 2, 3, 4, 5]), 2, scope="acme")
    assert index.draft(packed([1, 2]), 3, scope="acme") == ([3, 4, 5], 2)
    assert index.draft(packed([1, 2]), 3, scope="globex") == ([], 0)
    assert index.draft(packed([1, 2]), 3) == ([], 0)


def test_an_even_split_drafts_nothing_below_the_share() -> None:
    index = SuffixIndex(min_share=0.6)
    index.add(packed([1, 2, 3]), 2)
    index.add(packed([1, 2, 4]), 2)
    assert index.draft(packed([1, 2]), 4) == ([], 0)
    with pytest.raises(ValueError):
        SuffixIndex(min_context=3, max_context=2)


def test_the_table_forgets_the_contexts_least_recently_written() -> None:
    index = SuffixIndex(max_contexts=10)
    index.add(packed(list(range(100, 140))), 2)
    assert len(index) == 10
    index.check_integrity()
    assert index.draft(packed([100, 101]), 2) == ([], 0)  # the oldest are gone
    assert index.draft(packed([136, 137]), 2) == ([138, 139], 2)


def test_the_core_drafts_a_request_from_an_earlier_requests_output() -> None:
    limits = Limits(64, 4, 4, 128, 256, 16, 0.0, speculative_method="suffix", num_speculative_tokens=4)
    core = WorkerScheduler(limits)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    output = [40, 41, 42, 43, 44, 45]
    core.add(Sequence("a", "g", [7, 8, 9], params, EOS))
    for token_id in output:  # no draft: nothing in its own tokens or the index repeats
        plan = core.schedule()
        assert plan.draft_token_ids == ()
        core.postprocess(("a",), [token_id])
        core.check_integrity()
    assert "a" not in core.seqs and len(core.speculator.suffix) > 0
    core.add(Sequence("b", "g", [5, 8, 9], params, EOS))  # ends like a's prompt
    core.schedule()
    core.postprocess(("b",), [40])
    plan = core.schedule()
    assert [unpack_tokens(d) for d in plan.draft_token_ids] == [[41, 42, 43, 44]]
    core.postprocess(("b",), [41, 42, 99], num_sampled=[3])
    core.check_integrity()
    stats = core.speculator.stats["suffix"]
    assert (stats.num_drafted, stats.num_accepted) == (4, 2)
    assert core.seqs["b"].output_token_ids == [40, 41, 42, 99]
