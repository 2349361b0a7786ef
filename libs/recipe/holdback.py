"""Find the markers of one parser stage in streamed text, and say how much of its tail to hold back.

A stage of the output parser watches a few literal markers at once (stop sequences, `</think>`,
the start of a tool block, ...). `MarkerSet.search` finds the marker whose occurrence *ends*
first after a position (ties go to the marker listed first), which is what a byte-by-byte
automaton per marker reports; `MarkerSet.holdback` gives the longest tail of the text that could
still grow into a marker, which the parser must not emit yet.

Cost: every search starts at most one marker length before the text that is new since the last
search of the same stage (text before that was already shown to hold no complete marker), a
per-buffer cache of `str.find` results keeps several searches over one buffer linear overall,
and the newlines held before a newline-swallowing marker are counted by the caller, not re-read.
So a feed costs O(len(chunk)) plus O(longest marker²) for the holdback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Marker:
    """A literal the parser reacts to; `tag` names the reaction."""

    text: str
    tag: str
    # The match also takes any run of "\n" right before `text` (the run is dropped with it).
    newlines_before: bool = False
    # Matches only at the stage's first position, and only while the stage is "leading".
    only_leading: bool = False


@dataclass(frozen=True, slots=True)
class Hit:
    start: int  # buffer index where the match (with its swallowed newlines) begins
    end: int  # buffer index just past the match
    marker: Marker


class Finder:
    """`str.find` over one buffer, memoised per needle so repeated searches stay linear.

    Invariant per needle: no occurrence starts in [searched_from, found) (or anywhere after
    searched_from when found == -1), so a later search from `start >= searched_from` can reuse it.
    """

    __slots__ = ("_cache", "buf")

    def __init__(self, buf: str) -> None:
        self.buf = buf
        self._cache: dict[str, tuple[int, int]] = {}

    def find(self, needle: str, start: int) -> int:
        cached = self._cache.get(needle)
        if cached is not None:
            searched_from, found = cached
            if searched_from <= start and (found == -1 or found >= start):
                return found
        found = self.buf.find(needle, start)
        self._cache[needle] = (start, found)
        return found


def _newline_run_before(buf: str, lo: int, end: int) -> int:
    """How many "\n" end at buf[end - 1], not reaching before `lo`."""
    segment = buf[lo:end]
    return len(segment) - len(segment.rstrip("\n"))


def _partial_suffix(buf: str, lo: int, text: str) -> int:
    """Length of the longest suffix of buf[lo:] that is a proper prefix of `text`."""
    longest = min(len(text) - 1, len(buf) - lo)
    first = text[0] if text else ""
    for k in range(longest, 0, -1):
        # Cheap first-character test before the slice comparison.
        if buf[len(buf) - k] == first and buf.endswith(text[:k]):
            return k
    return 0


class MarkerSet:
    """The markers one stage watches, in priority order (for matches ending at the same place)."""

    __slots__ = ("markers",)

    def __init__(self, markers: Sequence[Marker]) -> None:
        self.markers = tuple(m for m in markers if m.text)

    def search(self, finder: Finder, pos: int, fresh: int, leading: bool) -> Hit | None:
        """The earliest-ending match in buf[pos:], or None.

        `fresh` is the first index not yet searched by this stage: no marker can be complete
        entirely before it, so each needle is looked for from `fresh - len(needle) + 1` on.
        """
        buf = finder.buf
        best: tuple[int, int, Marker] | None = None  # (index, end, marker)
        for marker in self.markers:
            if marker.only_leading:
                idx = pos if leading and buf.startswith(marker.text, pos) else -1
            else:
                idx = finder.find(marker.text, max(pos, fresh - len(marker.text) + 1))
            end = idx + len(marker.text)
            if idx >= 0 and (best is None or end < best[1]):
                best = (idx, end, marker)
        if best is None:
            return None
        idx, end, marker = best
        # Only the winner's newline run is measured: it is text the caller consumes anyway.
        start = idx - _newline_run_before(buf, pos, idx) if marker.newlines_before else idx
        return Hit(start, end, marker)

    def holdback(self, buf: str, pos: int, leading: bool, tail_newlines: int) -> int:
        """Length of the longest tail of buf[pos:] that could still become one of the markers.

        `tail_newlines` is how many "\n" end the buffer (the caller tracks it across feeds), so
        a long run of newlines held back for a newline-swallowing marker is not re-measured.
        """
        hold = 0
        rest = len(buf) - pos
        for marker in self.markers:
            if marker.only_leading:
                # Only a tail that starts at the stage's first position can still become it.
                if leading and rest < len(marker.text) and marker.text.startswith(buf[pos:]):
                    hold = max(hold, rest)
                continue
            k = _partial_suffix(buf, pos, marker.text)
            if marker.newlines_before:
                # A partial marker lasts a few feeds at most, so measuring the run then is cheap.
                k += _newline_run_before(buf, pos, len(buf) - k) if k else min(tail_newlines, rest)
            hold = max(hold, k)
        return hold
