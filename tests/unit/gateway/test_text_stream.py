"""ChoiceText: text and logprobs of one choice under detokenization, parsing and stop strings."""

from __future__ import annotations

import itertools
import random

import pytest

from libs.protocol.messages import FinishReason
from libs.recipe.output_parser import OutputParser, ParserSpec
from libs.recipe.segments import Content, Finish
from libs.recipe.tokenizer import Tokenizer
from services.gateway.logprobs import TokenLogprob
from services.gateway.request_stream import Delta
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
    spec = ParserSpec(syntax="plain", start="content", parse_tool_calls=False, stop=tuple(stop))
    choice = ChoiceText(tokenizer, OutputParser(spec), frozenset())
    bounds = [0, *cuts, len(ids)]
    lps = records(ids)
    pieces = []
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        last = i == len(bounds) - 2
        delta = Delta(ids[a:b], 3, b, 0, finish if last else None, logprobs=lps[a:b] if logprobs else ())
        pieces.append(choice.feed(delta))
        if choice.finish is not None:
            break
    return choice, pieces


def piece_text(piece: Piece) -> str:
    assert all(isinstance(s, Content) for s in piece.segments)  # plain syntax: content only
    return "".join(s.text for s in piece.segments if isinstance(s, Content))


def text(pieces: list[Piece]) -> str:
    return "".join(piece_text(p) for p in pieces)


def sent_ids(pieces: list[Piece]) -> list[int]:
    return [r.token_id for p in pieces for r in p.logprobs]


def test_a_split_character_goes_out_with_the_token_that_completes_it(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a 日b")  # " 日" is b" \xe6", b"\x97", b"\xa5": the last two alone are no text
    assert [tokenizer.token_bytes(t) for t in ids[1:4]] == [b" \xe6", b"\x97", b"\xa5"]
    choice, pieces = run(tokenizer, ids, list(range(1, len(ids))))
    assert [piece_text(p) for p in pieces] == ["a", " ", "", "日", "b"]
    assert [[r.token_id for r in p.logprobs] for p in pieces] == [[ids[0]], [ids[1]], [], ids[2:4], [ids[4]]]
    assert choice.finish == Finish("eos") and not choice.stopped and choice.num_output_tokens == len(ids)


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
    assert text(pieces) == "The an" and choice.stopped and choice.finish == Finish("stop_sequence", "swer is")
    assert sent_ids(pieces) == ids[:2]
    # A stop string that begins exactly where a token begins drops that token too.
    _, pieces = run(tokenizer, ids, [], stop=[" is"])
    assert (text(pieces), sent_ids(pieces)) == ("The answer", ids[:2])


def test_held_back_text_holds_its_records_until_released(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("go STOPPING")
    assert [tokenizer.token_bytes(t) for t in ids] == [b"go", b" ST", b"OP", b"P", b"ING"]
    choice, pieces = run(tokenizer, ids, [1, 2, 3, 4], stop=["STOP!"], finish=FinishReason.LENGTH)
    # "ST" and "STOP" might begin "STOP!": held back with their tokens until "STOPP" rules it out.
    assert [(piece_text(p), p.logprobs) for p in pieces[1:4]] == [
        (" ", ()),
        ("", ()),
        ("STOPP", records(ids)[1:4]),
    ]
    assert text(pieces) == "go STOPPING" and sent_ids(pieces) == ids
    assert choice.finish == Finish("length") and not choice.stopped


def test_special_tokens_have_records_but_no_text(tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_id or 0
    ids = [*tokenizer.encode("Hi"), eos]
    _, pieces = run(tokenizer, ids, list(range(1, len(ids))))
    assert text(pieces) == "Hi" and sent_ids(pieces) == ids
    assert piece_text(pieces[-1]) == ""
    assert pieces[-1].logprobs == (TokenLogprob(eos, -0.5 - (len(ids) - 1)),)


def test_without_logprobs_only_text_and_errors(tokenizer: Tokenizer) -> None:
    choice, pieces = run(
        tokenizer, tokenizer.encode("Hi there"), [1], finish=FinishReason.ERROR, logprobs=False
    )
    assert text(pieces) == "Hi there" and sent_ids(pieces) == []
    assert choice.finish == Finish("error", error="the request failed")
    assert choice.feed(Delta([5], 3, 9, 0, None)) == Piece([])  # nothing after the end
