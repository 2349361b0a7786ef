from __future__ import annotations

import pytest

from services.gateway.stop_strings import StopStringMatcher

TEXT = "The answer is 42.\nDone. END more text"


def run(stop: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopStringMatcher(stop)
    out = "".join(matcher.feed(p) for p in pieces)
    return out + matcher.flush(), matcher.stopped


@pytest.mark.parametrize("split", range(len(TEXT) + 1))
def test_every_two_way_split(split: int) -> None:
    assert run(["END", "\n\n"], [TEXT[:split], TEXT[split:]]) == ("The answer is 42.\nDone. ", True)


def test_one_char_at_a_time_and_no_match() -> None:
    assert run(["END"], list(TEXT)) == ("The answer is 42.\nDone. ", True)
    assert run(["NOPE"], list(TEXT)) == (TEXT, False)
    assert run([], [TEXT]) == (TEXT, False)


def test_partial_prefix_is_held_back_then_released() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go ST") == "go "
    assert matcher.feed("ART") == "START"
    assert matcher.feed("S") == ""
    assert matcher.flush() == "S"


def test_earliest_stop_string_wins() -> None:
    assert run(["b", "a"], ["xxabxx"]) == ("xx", True)
