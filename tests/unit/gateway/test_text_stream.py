"""ChoiceText: text and logprobs of one choice under detokenization and stop strings."""

from __future__ import annotations

import itertools
import random

import pytest

from libs.protocol.messages import FinishReason
from libs.recipe.tokenizer import Tokenizer
from services.gateway.logprobs import TokenLogprob
from services.gateway.service import Delta
from services.gateway.text_stream import ChoiceText, Piece


def records(ids: list[int]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(t, -0.5 - i) for i, t in enumerate(ids))


def run(
    tokenizer: Tokenizer,
    ids: list[int],
    cuts: list[int],
    stop: list[str] = [],  # noqa: B006 - never mutated
    finish: FinishReason = FinishReason.STOP,
    logprobs: bool = True,
) -> tuple[ChoiceText, list[Piece]]:
    """Feed ``ids`` as deltas split at ``cuts``; the last delta carries ``finish``."""
    choice = ChoiceText(tokenizer, stop)
    bounds = [0, *cuts, len(ids)]
    lps = records(ids)
    pieces = []
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        last = i == len(bounds) - 2
        delta = Delta(ids[a:b], 3, b, 0, finish if last else None, logprobs=lps[a:b] if logprobs else ())
        pieces.append(choice.feed(delta))
        if choice.finish_reason is not None:
            break
    return choice, pieces


def text(pieces: list[Piece]) -> str:
    return "".join(p.text for p in pieces)


def sent_ids(pieces: list[Piece]) -> list[int]:
    return [r.token_id for p in pieces for r in p.logprobs]


def test_a_split_character_goes_out_with_the_token_that_completes_it(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a 日b")  # " 日" is b" \xe6", b"\x97", b"\xa5": the last two alone are no text
    assert [tokenizer.token_bytes(t) for t in ids[1:4]] == [b" \xe6", b"\x97", b"\xa5"]
    choice, pieces = run(tokenizer, ids, list(range(1, len(ids))))
    assert [p.text for p in pieces] == ["a", " ", "", "日", "b"]
    assert [[r.token_id for r in p.logprobs] for p in pieces] == [[ids[0]], [ids[1]], [], ids[2:4], [ids[4]]]
    assert choice.finish_reason == "stop" and not choice.stopped and choice.num_output_tokens == len(ids)


@pytest.mark.parametrize("seed", range(20))
def test_any_split_gives_the_same_text_and_records(tokenizer: Tokenizer, seed: int) -> None:
    ids = [*tokenizer.encode("The café 日本 🙂 is open. END of it"), tokenizer.eos_token_id or 0]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(0, len(ids) - 1)))
    whole = run(tokenizer, ids, [], stop=["END"])[1]
    _, pieces = run(tokenizer, ids, cuts, stop=["END"])
    assert text(pieces) == text(whole) == "The café 日本 🙂 is open. "
    assert sent_ids(pieces) == sent_ids(whole)


def test_stop_string_keeps_tokens_begun_before_it_and_drops_the_rest(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The answer is here")
    spelled = [tokenizer.token_bytes(t).decode() for t in ids]
    assert spelled[:3] == ["The", " answer", " is"]
    # "swer is" begins inside " answer": that token straddles the stop and is kept, " is" is not.
    choice, pieces = run(tokenizer, ids, [1, 2, 3], stop=["swer is"])
    assert text(pieces) == "The an" and choice.stopped and choice.finish_reason == "stop"
    assert sent_ids(pieces) == ids[:2]
    # A stop string that begins exactly where a token begins drops that token too.
    _, pieces = run(tokenizer, ids, [], stop=[" is"])
    assert (text(pieces), sent_ids(pieces)) == ("The answer", ids[:2])


def test_held_back_text_holds_its_records_until_released(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("go STOPPING")
    assert [tokenizer.token_bytes(t) for t in ids] == [b"go", b" ST", b"OP", b"P", b"ING"]
    choice, pieces = run(tokenizer, ids, [1, 2, 3, 4], stop=["STOP!"], finish=FinishReason.LENGTH)
    # "ST" and "STOP" might begin "STOP!": held back with their tokens until "STOPP" rules it out.
    assert pieces[1:4] == [Piece(" "), Piece(""), Piece("STOPP", records(ids)[1:4])]
    assert text(pieces) == "go STOPPING" and sent_ids(pieces) == ids
    assert choice.finish_reason == "length" and not choice.stopped


def test_special_tokens_have_records_but_no_text(tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_id or 0
    ids = [*tokenizer.encode("Hi"), eos]
    _, pieces = run(tokenizer, ids, list(range(1, len(ids))))
    assert text(pieces) == "Hi" and sent_ids(pieces) == ids
    assert pieces[-1] == Piece("", (TokenLogprob(eos, -0.5 - (len(ids) - 1)),))


def test_without_logprobs_only_text_and_errors(tokenizer: Tokenizer) -> None:
    choice, pieces = run(
        tokenizer, tokenizer.encode("Hi there"), [1], finish=FinishReason.ERROR, logprobs=False
    )
    assert text(pieces) == "Hi there" and sent_ids(pieces) == []
    assert choice.error == "the request failed" and choice.finish_reason == "abort"
    assert choice.feed(Delta([5], 3, 9, 0, None)) == Piece("")  # nothing after the end
