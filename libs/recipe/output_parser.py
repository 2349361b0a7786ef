"""Turn one choice's streamed output text into segments: reasoning, content and tool calls. Pure.

The parser is a stage machine in the manner of deepseek-recipe's: each stage watches a few
literal markers (`holdback.MarkerSet`); text before a marker gets the stage's action (reasoning,
content, a tool name, an argument value, or skipped), a marker moves to the next stage, and the
tail that could still become a marker is held back until the next feed. Feeding the same text in
any chunking therefore yields the same concatenated segments.

Syntaxes:
- "deepseek": `</think>` ends reasoning; `<｜DSML｜` opens a tool block (V4 `tool_calls`/`invoke`/
  `parameter` and V4.1 ` calls`/` invoke`/` parameter` alike, with or without the outer wrapper),
  whose parameters are synthesised into argument JSON as they stream. Text after the block ends,
  and text inside it that is not an invoke, is dropped, as deepseek-recipe does. Unlike it, a
  `string="false"` value that is not valid JSON is emitted as a JSON string.
- "hermes": optional `<think>...</think>` first; `<tool_call>\\n{"name": ..., "arguments": ...}\\n
  </tool_call>` calls (see `hermes.HermesCall`), with content allowed before, between and after.
  A call whose name never parses (syntax error, no name, or the output ends first) is content.
- "plain": content only, or reasoning first when the prompt leaves the model in reasoning.

Stop sequences are matched in content only, never in reasoning or tool markup.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import Enum, auto
from typing import Literal

from libs.recipe.dsml import DSML, THINK_END, THINK_START
from libs.recipe.hermes import HermesCall
from libs.recipe.holdback import Finder, Hit, Marker, MarkerSet
from libs.recipe.segments import Content, Reasoning, Segment, ToolCallArgs, ToolCallStart

Syntax = Literal["deepseek", "hermes", "plain"]
Stage = Literal["content", "reasoning", "tool_calls"]
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# Every spelling a marker of any syntax is made of: a vocabulary that makes one of them a special
# token must leave it in the decoded text, or the parser never sees it.
MARKER_SPELLINGS = (THINK_START, THINK_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, DSML)
_DSML = DSML
_ALPHANUMERIC = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True, slots=True)
class ParserSpec:
    syntax: Syntax
    start: Stage  # the stage the prompt leaves the model in
    parse_tool_calls: bool
    stop: tuple[str, ...] = ()  # matched in content only
    call_id_seed: str = ""  # tool-call ids are a function of (seed, call index)

    def __post_init__(self) -> None:
        if self.start == "tool_calls" and (self.syntax == "plain" or not self.parse_tool_calls):
            raise ValueError("start='tool_calls' needs a tool-call syntax and parse_tool_calls")


def tool_call_id(seed: str, index: int) -> str:
    """`call_{NN}_{24 alphanumerics}`, deterministic so re-rendering an output gives the same ids."""
    number = int.from_bytes(hashlib.sha256(f"{seed}\x00{index}".encode()).digest(), "big")
    chars = []
    for _ in range(24):
        number, digit = divmod(number, len(_ALPHANUMERIC))
        chars.append(_ALPHANUMERIC[digit])
    return f"call_{index:02d}_{''.join(chars)}"


class _Stage(Enum):
    REASONING = auto()
    CONTENT = auto()
    CONTENT_START = auto()  # hermes: content that may still open with <think>
    STOPPED = auto()  # a stop sequence matched
    BLOCK = auto()  # deepseek: inside the tool block, between invokes
    NAME = auto()  # deepseek: the invoke's name
    ARGS = auto()  # deepseek: inside an invoke, between parameters
    PARAM_NAME = auto()
    PARAM_TYPE = auto()
    VALUE_STR = auto()  # string="true": streamed, JSON-escaped
    VALUE_RAW = auto()  # string="false": buffered to its end, then checked
    DONE = auto()  # deepseek: after the tool block; everything is dropped
    CALL = auto()  # hermes: inside a call's JSON body (HermesCall, not markers)
    AFTER_CALL = auto()  # hermes: after the body, until </tool_call>


def _stage_markers(spec: ParserSpec) -> dict[_Stage, MarkerSet]:
    think_end = Marker(THINK_END, "think_end", newlines_before=True)
    leading = Marker("\n", "skip", only_leading=True)
    stray_end = Marker(THINK_END, "stray")
    stops = [Marker(s, "stop") for s in dict.fromkeys(spec.stop) if s]
    tools: list[Marker] = []
    if spec.parse_tool_calls and spec.syntax == "deepseek":
        tools = [Marker("<" + _DSML, "block", newlines_before=True)]
    elif spec.parse_tool_calls and spec.syntax == "hermes":
        tools = [Marker(TOOL_CALL_OPEN, "call", newlines_before=True)]
    # Plain output keeps a stray </think> (it has no reasoning syntax to repair).
    content = [*stops, leading] if spec.syntax == "plain" else [*stops, *tools, leading, stray_end]
    think = Marker(THINK_START, "think", only_leading=True)
    dsml_close = Marker("</" + _DSML, "close")
    return {
        _Stage.REASONING: MarkerSet([*tools, leading, think_end]),
        _Stage.CONTENT: MarkerSet(content),
        _Stage.CONTENT_START: MarkerSet([*content, think]),
        _Stage.BLOCK: MarkerSet(
            [
                Marker('invoke name="', "invoke"),
                Marker(f"</{_DSML}tool_calls>", "done"),
                Marker(f"</{_DSML} calls>", "done"),
            ]
        ),
        _Stage.NAME: MarkerSet([Marker('"', "name")]),
        _Stage.ARGS: MarkerSet([Marker('parameter name="', "param"), dsml_close]),
        _Stage.PARAM_NAME: MarkerSet([Marker('"', "param_name")]),
        _Stage.PARAM_TYPE: MarkerSet([Marker('true">', "string"), Marker('false">', "json")]),
        _Stage.VALUE_STR: MarkerSet([dsml_close]),
        _Stage.VALUE_RAW: MarkerSet([dsml_close]),
        _Stage.AFTER_CALL: MarkerSet([Marker(TOOL_CALL_CLOSE, "call_end"), Marker(TOOL_CALL_OPEN, "call")]),
    }


def _json_value(text: str) -> str:
    """A `string="false"` value as argument JSON: itself if valid JSON, else a JSON string of it."""

    def reject(constant: str) -> object:  # NaN and Infinity are not JSON
        raise ValueError(constant)

    try:
        json.loads(text, parse_constant=reject)
    except ValueError:  # JSONDecodeError is a ValueError
        return json.dumps(text, ensure_ascii=False)
    return text


def merge_segments(segments: list[Segment]) -> list[Segment]:
    """Drop empty texts and join neighbours of the same kind (and the same call)."""
    out: list[Segment] = []
    for seg in segments:
        if isinstance(seg, ToolCallStart):
            out.append(seg)
            continue
        if not seg.text:
            continue
        last = out[-1] if out else None
        if isinstance(seg, Reasoning) and isinstance(last, Reasoning):
            out[-1] = Reasoning(last.text + seg.text)
        elif isinstance(seg, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + seg.text)
        elif isinstance(seg, ToolCallArgs) and isinstance(last, ToolCallArgs) and last.index == seg.index:
            out[-1] = ToolCallArgs(seg.index, last.text + seg.text)
        else:
            out.append(seg)
    return out


class OutputParser:
    """Streaming parser for one choice. `feed` text as it is decoded, then `finish` once."""

    def __init__(self, spec: ParserSpec) -> None:
        self.spec = spec
        self._markers = _stage_markers(spec)
        self._out: list[Segment] = []
        self._stash = ""  # tail of the fed text that may still become a marker
        self._fed = 0
        self._tail_newlines = 0  # how many "\n" end the fed text
        self._stop: str | None = None
        self._stop_offset: int | None = None
        self._calls = 0
        # deepseek tool-call state
        self._name = ""  # the invoke's or parameter's name so far
        self._first_param = True
        self._raw_value = ""
        # hermes tool-call state
        self._call: HermesCall | None = None
        self._call_origin = 0  # offset in the fed text just past the call's opening marker
        self._call_opener = ""  # the opening marker's text, content again if the call fails
        self._call_return = _Stage.CONTENT  # where a failed call's text is re-read
        self._stage, self._leading = self._initial_stage()

    def _initial_stage(self) -> tuple[_Stage, bool]:
        spec = self.spec
        if spec.start == "reasoning":
            return _Stage.REASONING, True
        if spec.start == "tool_calls":
            if spec.syntax == "hermes":
                self._call = HermesCall()
                return _Stage.CALL, False
            return _Stage.BLOCK, False
        if spec.syntax == "hermes":
            return _Stage.CONTENT_START, True
        return _Stage.CONTENT, spec.syntax == "deepseek"  # plain content is verbatim

    # -- public API --------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self._stage is _Stage.STOPPED

    @property
    def stop_sequence(self) -> str | None:
        return self._stop

    @property
    def stop_offset(self) -> int | None:
        return self._stop_offset

    @property
    def reasoning(self) -> bool:
        """Inside the reasoning now."""
        return self._stage is _Stage.REASONING

    @property
    def may_reason(self) -> bool:
        """Inside the reasoning, or at a start that may still open it (hermes ``<think>``)."""
        return self._stage in (_Stage.REASONING, _Stage.CONTENT_START)

    @property
    def num_tool_calls(self) -> int:
        return self._calls

    @property
    def num_consumed(self) -> int:
        if self._stop_offset is not None:
            return self._stop_offset
        pending = self._call.raw_len if self._call is not None and self._call.name is None else 0
        return self._fed - len(self._stash) - pending

    def feed(self, text: str) -> list[Segment]:
        if self.finished or not text:
            return []
        base, fresh = self._fed - len(self._stash), len(self._stash)
        self._fed += len(text)
        run = len(text) - len(text.rstrip("\n"))
        self._tail_newlines = run + self._tail_newlines if run == len(text) else run
        # Dropping the attribute's reference first lets CPython extend the stash in place, so a
        # long held run of newlines is not copied on every feed.
        buf, self._stash = self._stash, ""
        buf += text
        self._run(buf, base, fresh, final=False)
        return self._take()

    def finish(self) -> list[Segment]:
        """The output ended: flush what was held back, and end an unterminated tool call."""
        if self.finished:
            return []
        buf, self._stash = self._stash, ""
        self._run(buf, self._fed - len(buf), len(buf), final=True)
        if self._stage is _Stage.VALUE_RAW:
            self._args(_json_value(self._raw_value))
        return self._take()

    def _take(self) -> list[Segment]:
        out, self._out = merge_segments(self._out), []
        return out

    # -- the stage machine -------------------------------------------------------------------

    def _run(self, buf: str, base: int, fresh: int, final: bool) -> None:
        """Parse buf (which starts at offset `base` of the fed text); keep the undecided tail."""
        finder, pos = Finder(buf), 0
        while True:
            if self._stage is _Stage.CALL:
                resumed = self._in_call(buf, pos, base, final)
                if resumed is None:
                    return
                buf, pos, base = resumed
                if resumed[0] is not finder.buf:
                    finder = Finder(buf)
                fresh = pos
                continue
            markers = self._markers.get(self._stage)
            hit = markers.search(finder, pos, fresh, self._leading) if markers else None
            if hit is None:
                hold = 0
                if markers is not None and not final:
                    hold = markers.holdback(buf, pos, self._leading, self._tail_newlines)
                self._text(buf[pos : len(buf) - hold])
                self._stash = buf[len(buf) - hold :]
                return
            self._text(buf[pos : hit.start])
            if hit.marker.tag == "stop":
                self._stage, self._stop, self._stop_offset = _Stage.STOPPED, hit.marker.text, base + hit.start
                self._stash = ""
                return
            self._on_marker(hit, buf, base)
            pos = fresh = hit.end

    def _text(self, text: str) -> None:
        """Text before a marker (or before the held-back tail): the current stage's action."""
        if not text:
            return
        stage = self._stage
        if stage is _Stage.REASONING:
            self._out.append(Reasoning(text))
        elif stage in (_Stage.CONTENT, _Stage.CONTENT_START):
            self._out.append(Content(text))
        elif stage in (_Stage.NAME, _Stage.PARAM_NAME):
            self._name += text
        elif stage is _Stage.VALUE_STR:
            self._args(json.dumps(text, ensure_ascii=False)[1:-1])
        elif stage is _Stage.VALUE_RAW:
            self._raw_value += text
        else:
            return  # markup or text the syntax drops: the stage stays as it was
        self._leading = False

    def _args(self, text: str) -> None:
        self._out.append(ToolCallArgs(self._calls - 1, text))

    def _start_call(self, name: str) -> None:
        self._out.append(ToolCallStart(self._calls, tool_call_id(self.spec.call_id_seed, self._calls), name))
        self._calls += 1

    def _goto(self, stage: _Stage, leading: bool = False) -> None:
        self._stage, self._leading = stage, leading

    def _on_marker(self, hit: Hit, buf: str, base: int) -> None:
        tag = hit.marker.tag
        if tag == "skip":
            return  # a leading newline: dropped, and the next one is leading too
        if tag == "stray":
            self._leading = False  # a stray </think>: dropped, and the text after it is kept whole
            return
        if tag == "think":
            self._goto(_Stage.REASONING, leading=True)
        elif tag in ("think_end", "call_end"):
            self._goto(_Stage.CONTENT, leading=True)
        elif tag == "call":
            self._call = HermesCall()
            self._call_origin, self._call_opener = base + hit.end, buf[hit.start : hit.end]
            self._call_return = _Stage.REASONING if self._stage is _Stage.REASONING else _Stage.CONTENT
            self._goto(_Stage.CALL)
        else:
            self._on_dsml(tag)

    def _on_dsml(self, tag: str) -> None:
        """Markers of the DSML tool block; argument JSON is synthesised from the parse state."""
        stage = self._stage
        if tag == "block":
            self._goto(_Stage.BLOCK)
        elif tag == "invoke":
            self._name = ""
            self._goto(_Stage.NAME)
        elif tag == "name":
            self._start_call(self._name)
            self._first_param = True
            self._goto(_Stage.ARGS)
        elif tag == "param":
            self._args("{" if self._first_param else ", ")
            self._first_param, self._name = False, ""
            self._goto(_Stage.PARAM_NAME)
        elif tag == "param_name":
            self._args(json.dumps(self._name, ensure_ascii=False) + ": ")
            self._goto(_Stage.PARAM_TYPE)
        elif tag == "string":
            self._args('"')
            self._goto(_Stage.VALUE_STR)
        elif tag == "json":
            self._raw_value = ""
            self._goto(_Stage.VALUE_RAW)
        elif tag == "close" and stage is _Stage.ARGS:  # </｜DSML｜ invoke>
            self._args("{}" if self._first_param else "}")
            self._goto(_Stage.BLOCK)
        elif tag == "close":  # </｜DSML｜ parameter>
            self._args('"' if stage is _Stage.VALUE_STR else _json_value(self._raw_value))
            self._goto(_Stage.ARGS)
        elif tag == "done":
            self._goto(_Stage.DONE)

    def _in_call(self, buf: str, pos: int, base: int, final: bool) -> tuple[str, int, int] | None:
        """Feed a hermes call body; return where parsing resumes (buf, pos, base), or None at the end.

        A call that turns out not to be one is re-read as text of the stage it interrupted,
        from just past its opening marker (which is emitted as text first).
        """
        call = self._call
        assert call is not None
        end = call.feed(buf, pos)
        if end < 0 and final:
            call.finish()
        if call.name is not None:
            if not call.started:
                call.started = True
                self._start_call(call.name)
            self._args(call.take_args())
        if call.failed:
            rest = buf[end:] if end >= 0 else ""
            self._stage, self._leading = self._call_return, False
            self._text(self._call_opener)
            self._call = None
            return "".join(call.raw) + rest, 0, self._call_origin
        if end < 0:
            self._stash = ""
            return None
        self._call = None
        self._goto(_Stage.AFTER_CALL)
        return buf, end, base
