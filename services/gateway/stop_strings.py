"""Stop strings over streamed text. Pure.

Text is released only once it cannot be the start of a stop string: after each feed everything
except the longest tail that is a proper prefix of some stop string goes out, so a stop string split
across steps is still caught and never partly shown.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self._pending = ""  # held back: might begin a stop string
        self.stopped = False

    def feed(self, text: str) -> str:
        """Returns the text safe to emit; after a match, ``stopped`` is set and the rest is dropped."""
        if self.stopped:
            return ""
        buf = self._pending + text
        hits = [i for i in (buf.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return buf[: min(hits)]
        hold = self._longest_partial(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _longest_partial(self, buf: str) -> int:
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
