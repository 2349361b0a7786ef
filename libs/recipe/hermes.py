"""Parse the JSON body of one Hermes-style `<tool_call>` incrementally, streaming its arguments.

The body is `{"name": NAME, "arguments": {...}}` (`"parameters"` is accepted for "arguments").
The arguments value is passed through as raw JSON text, fragment by fragment, while a small
scanner tracks strings, escapes and nesting to find where it ends; the text is never re-scanned.

A call is tentative until its name is known: until then its raw text is kept, and if the body
turns out not to be a call (a syntax error, an object without a name, or the end of the output)
`HermesCall.failed` is set and the owner treats that raw text as content. Once the name is known
the call is reported and problems later on are handled best-effort: the arguments end where
they got to (`{}` if they never started) and the owner skips to `</tool_call>`.
"""

from __future__ import annotations

import json
import re
from enum import Enum, auto

# Characters that end a run of ordinary characters.
_STRING_STOP = re.compile(r'["\\]')
# Outside strings: structural characters, and anything a JSON value may not contain.
_CONTAINER_STOP = re.compile(r"[^\s,:0-9A-Za-z+\-.]")
_SCALAR = re.compile(r"[0-9A-Za-z+\-.]*")
_SPACE = re.compile(r"\s*")
_ARGUMENT_KEYS = ("arguments", "parameters")


class ValueScanner:
    """Finds where one JSON value ends in text that arrives in pieces. Does not validate scalars."""

    __slots__ = ("depth", "error", "escape", "in_string", "kind")

    def __init__(self) -> None:
        self.kind = ""  # "", "string", "container" or "scalar", set by the first character
        self.depth = 0
        self.in_string = False
        self.escape = False  # the last character seen was a backslash inside a string
        self.error = False  # a character no JSON value may contain ended the value early

    def feed(self, buf: str, i: int) -> tuple[int, bool]:
        """Scan buf[i:]; return (index just past what belongs to the value, whether it is complete)."""
        if not self.kind:
            first = buf[i]
            self.kind = "string" if first == '"' else "container" if first in "{[" else "scalar"
            if self.kind == "string":
                self.in_string = True
                i += 1
        if self.kind == "scalar":
            end = _SCALAR.match(buf, i).end()  # type: ignore[union-attr]  # `*` always matches
            return end, end < len(buf)
        return self._scan_nested(buf, i)

    def _scan_nested(self, buf: str, i: int) -> tuple[int, bool]:
        n = len(buf)
        while i < n:
            if self.escape:
                self.escape = False
                i += 1
                continue
            if self.in_string:
                m = _STRING_STOP.search(buf, i)
                if m is None:
                    return n, False
                i = m.end()
                if m.group() == "\\":
                    self.escape = True
                    continue
                self.in_string = False
                if self.kind == "string":
                    return i, True
                continue
            m = _CONTAINER_STOP.search(buf, i)
            if m is None:
                return n, False
            ch, i = m.group(), m.start()
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, True
            else:
                self.error = True
                return i, True
            i += 1
        return n, False


class _At(Enum):
    OPEN = auto()  # before the object's "{"
    KEY = auto()  # after "{" or ",": a key or "}"
    IN_KEY = auto()
    COLON = auto()
    VALUE = auto()  # after ":", before the value's first character
    IN_VALUE = auto()
    AFTER_VALUE = auto()  # "," or "}"
    DONE = auto()


class HermesCall:
    """One tool call's body. `feed` returns where the body ended (or -1) and what became known."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.raw: list[str] = []  # the body's text while the call is tentative (name unknown)
        self.raw_len = 0
        self.failed = False  # not a call after all: the owner re-reads `raw` as content
        self.started = False  # the owner has reported the call (set by the owner)
        self._at = _At.OPEN
        self._key = ""
        self._scanner = ValueScanner()
        self._role = ""  # what the current value is: "name", "args" or "" (ignored)
        self._value_buf: list[str] = []  # the current value's text, unless it streams
        self._args_seen = False  # an arguments value has begun (later ones are ignored)
        self._args_out: list[str] = []  # argument text not yet taken by the owner

    def take_args(self) -> str:
        """Argument text parsed since the last call (buffered while the name is unknown)."""
        text = "".join(self._args_out)
        self._args_out.clear()
        return text

    def feed(self, buf: str, i: int) -> int:
        """Consume buf[i:]. Return -1 if the body continues past it, else the index where it ended.

        On a syntax error the body ends *before* the offending character, so the owner reads it
        again (it is often the `<` of `</tool_call>`).
        """
        start = i
        n = len(buf)
        while i < n and self._at is not _At.DONE:
            i = self._step(buf, i)
        if self.name is None:
            self.raw.append(buf[start:i])
            self.raw_len += i - start
        return i if self._at is _At.DONE else -1

    def finish(self) -> None:
        """The output ended inside the body: flush a scalar argument or give up a nameless call."""
        if self._at is _At.IN_VALUE and self._role == "args" and self._scanner.kind != "container":
            self._args_out.append(_scalar_arguments("".join(self._value_buf)))
        if self.name is None:
            self.failed = True

    def _fail(self, i: int) -> int:
        if self.name is None:
            self.failed = True
        elif not self._args_seen:
            self._args_seen = True
            self._args_out.append("{}")
        self._at = _At.DONE
        return i

    def _step(self, buf: str, i: int) -> int:
        """Advance over one structural token (or one run of a value); return the next index."""
        at = self._at
        if at is _At.IN_VALUE:
            return self._in_value(buf, i)
        if at is _At.IN_KEY:
            return self._in_key(buf, i)
        i = _SPACE.match(buf, i).end()  # type: ignore[union-attr]  # `*` always matches
        if i == len(buf):
            return i
        ch = buf[i]
        if at is _At.OPEN:
            return self._goto(_At.KEY, i + 1) if ch == "{" else self._fail(i)
        if at is _At.KEY and ch == '"':
            self._scanner, self._key = ValueScanner(), ""
            return self._goto(_At.IN_KEY, i)
        if at is _At.COLON:
            return self._goto(_At.VALUE, i + 1) if ch == ":" else self._fail(i)
        if at is _At.VALUE:
            self._begin_value()
            return self._goto(_At.IN_VALUE, i)
        if at is _At.AFTER_VALUE and ch == ",":
            return self._goto(_At.KEY, i + 1)
        if ch == "}" and at in (_At.KEY, _At.AFTER_VALUE):
            self._close()
            return i + 1
        return self._fail(i)

    def _goto(self, at: _At, i: int) -> int:
        self._at = at
        return i

    def _in_key(self, buf: str, i: int) -> int:
        end, done = self._scanner.feed(buf, i)
        self._key += buf[i:end]
        if done:
            try:
                self._key = json.loads(self._key)
            except json.JSONDecodeError:
                return self._fail(end)
            self._at = _At.COLON
        return end

    def _begin_value(self) -> None:
        self._scanner = ValueScanner()
        self._value_buf = []
        if self._key == "name" and self.name is None:
            self._role = "name"
        elif self._key in _ARGUMENT_KEYS and not self._args_seen:
            self._role = "args"
            self._args_seen = True
        else:
            self._role = ""

    def _in_value(self, buf: str, i: int) -> int:
        scanner = self._scanner
        end, done = scanner.feed(buf, i)
        piece = buf[i:end]
        if self._role == "args" and scanner.kind == "container":
            self._args_out.append(piece)  # passed through as it arrives
        else:
            self._value_buf.append(piece)
        if done:
            if scanner.error:
                return self._fail(end)
            self._end_value("".join(self._value_buf))
        return end

    def _end_value(self, text: str) -> None:
        """A value is complete: `text` is its raw JSON unless it was streamed."""
        self._at = _At.AFTER_VALUE
        if self._role == "name":
            try:
                name = json.loads(text)
            except json.JSONDecodeError:
                name = None
            if not isinstance(name, str) or not name:
                self._fail(0)  # a call needs a string name: this body is not a call
                return
            self.name = name
        elif self._role == "args" and self._scanner.kind != "container":
            self._args_out.append(_scalar_arguments(text))

    def _close(self) -> None:
        self._at = _At.DONE
        if self.name is None:
            self.failed = True
        elif not self._args_seen:
            self._args_seen = True
            self._args_out.append("{}")


def _scalar_arguments(text: str) -> str:
    """Arguments given as a string or scalar: unwrap a string holding JSON, map null to {}."""
    text = text.strip()
    if text == "null" or not text:
        return "{}"
    if text.startswith('"'):
        try:
            inner = json.loads(text)
            json.loads(inner)
        except (json.JSONDecodeError, TypeError):
            return text
        return str(inner)
    return text
