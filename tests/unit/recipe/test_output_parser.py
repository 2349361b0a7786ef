"""OutputParser: any chunking of a model output gives the same reasoning, content and tool calls.

Each case is a model output built from the intended result (so the expectation is independent
of the parser), fed whole, split at every 2-way boundary, one character at a time, and in random
chunks; deepseek cases are also compared with deepseek-recipe's parser fed the same chunks.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from libs.recipe.output_parser import OutputParser, ParserSpec
from libs.recipe.segments import Reasoning, Segment, ToolCallArgs, ToolCallStart

Call = tuple[str, dict[str, Any]]
MARKERS = ("<｜DSML｜", "｜DSML｜", "</think>", "<tool_call>", "</tool_call>")
# A string value with what JSON must escape, non-BMP and CJK text, and near-markers.
TRICKY = 'q"uo\\te\nnew line\ttab \x01 😀👍🏽 中文字符 } ] {"x": 1} </｜DSM x <｜DSML </think'
CALLS: list[Call] = [
    ("get_weather", {"city": "Paris 巴黎", "days": 3, "units": None}),
    ("search", {"query": TRICKY, "filters": {"tags": ["a", "b\\c", 1.5, True], "nested": {"k": [[], {}]}}}),
    ("ping", {}),
]


def dsml(calls: list[Call], v41: bool = True, wrapper: bool = True) -> str:
    """The DSML block a DeepSeek model writes for `calls` (V4.1 or V4 spelling)."""
    sp, outer = (" ", " calls") if v41 else ("", "tool_calls")
    lines = [f"<｜DSML｜{outer}>"] if wrapper else []
    for name, params in calls:
        lines.append(f'<｜DSML｜{sp}invoke name="{name}">')
        for key, value in params.items():
            is_str = isinstance(value, str)
            text = value if is_str else json.dumps(value, ensure_ascii=False)
            flag = "true" if is_str else "false"
            lines.append(
                f'<｜DSML｜{sp}parameter name="{key}" string="{flag}">{text}</｜DSML｜{sp}parameter>'
            )
        lines.append(f"</｜DSML｜{sp}invoke>")
    if wrapper:
        lines.append(f"</｜DSML｜{outer}>")
    return "\n".join(lines)


def hermes(calls: list[Call], args_first: bool = False, indent: int | None = None) -> str:
    parts = []
    for name, args in calls:
        body = {"arguments": args, "name": name} if args_first else {"name": name, "arguments": args}
        parts.append(
            f"<tool_call>\n{json.dumps(body, indent=indent, ensure_ascii=indent is None)}\n</tool_call>"
        )
    return "\n".join(parts)


@dataclass
class Case:
    name: str
    spec: ParserSpec
    text: str
    reasoning: str = ""
    content: str = ""
    calls: list[Call] = field(default_factory=list)
    stop: str | None = None
    golden: bool = True  # deepseek cases: also compare with deepseek-recipe


def ds(start: str = "reasoning", tools: bool = True, stop: tuple[str, ...] = ()) -> ParserSpec:
    return ParserSpec("deepseek", start, tools, stop=stop, call_id_seed="seed")  # type: ignore[arg-type]


def hs(start: str = "content", tools: bool = True, stop: tuple[str, ...] = ()) -> ParserSpec:
    return ParserSpec("hermes", start, tools, stop=stop, call_id_seed="seed")  # type: ignore[arg-type]


LOOKALIKE = "Use <｜DSM L｜ or </thinking> or </think > or <think> or <tool_calls> or <tool_cal."
CASES = [
    Case(
        "ds-v41",
        ds(),
        "\n\nLet me think 🤔\n\n about 中文.\n\n</think>\n\nIt is sunny. \n\n" + dsml(CALLS),
        "Let me think 🤔\n\n about 中文.",
        "It is sunny. ",
        CALLS,
    ),
    Case(
        "ds-v4",
        ds(),
        "Reason </thin k>.</think>Answer:\n" + dsml(CALLS, v41=False) + "\nafter text dropped",
        "Reason </thin k>.",
        "Answer:",
        CALLS,
    ),
    Case(
        "ds-content-start",
        ds("content"),
        "\n" + LOOKALIKE.replace("<｜DSM", "<｜DS") + "</think>!\n\n",
        content=LOOKALIKE.replace("<｜DSM", "<｜DS") + "!\n\n",
    ),
    Case(
        "ds-calls-from-reasoning",
        ds(),
        "Plan: call now.\n\n" + dsml(CALLS[:1]),
        "Plan: call now.",
        "",
        CALLS[:1],
    ),
    Case("ds-start-in-calls-no-wrapper", ds("tool_calls"), "\n" + dsml(CALLS, wrapper=False), calls=CALLS),
    Case("ds-no-tools", ds("content", tools=False), "a <｜DSML｜ invoke b", content="a <｜DSML｜ invoke b"),
    Case(
        "ds-stop",
        ds(stop=("END", "\n\nUser:")),
        "think END here</think>Answer 42\n\nUse\n\nUser: more END",
        "think END here",
        "Answer 42\n\nUse",
        stop="\n\nUser:",
    ),
    Case(
        "ds-stop-not-in-args",
        ds("content", stop=("END",)),
        "call:" + dsml([("f", {"s": "x END y"})]),
        content="call:",
        calls=[("f", {"s": "x END y"})],
    ),
    Case("ds-reasoning-unterminated", ds(), "still thinking\n\n", "still thinking\n\n"),
    Case(
        "hermes-full",
        hs(),
        "<think>\nhmm 🤔 <tool_call> is a tag\n</think>\n\nSure 中文.\n"
        + hermes([*CALLS, ("html", {"s": "</tool_call> <tool_call>"})])
        + "\nDone.",
        "hmm 🤔 <tool_call> is a tag",
        "Sure 中文.Done.",
        [*CALLS, ("html", {"s": "</tool_call> <tool_call>"})],
    ),
    Case(
        "hermes-args-first-indent",
        hs(),
        "Calling.\n\n" + hermes(CALLS, args_first=True, indent=2),
        content="Calling.",
        calls=CALLS,
    ),
    Case(
        "hermes-start-reasoning",
        hs("reasoning"),
        "r1\n</think>\n" + LOOKALIKE + "\n" + hermes(CALLS[1:]),
        "r1",
        LOOKALIKE,
        CALLS[1:],
    ),
    Case(
        "hermes-stop",
        hs(stop=("STOP",)),
        "<think>STOP in reasoning</think>" + hermes([("f", {"s": "STOP"})]) + "\nthen STOP tail",
        "STOP in reasoning",
        "then ",
        [("f", {"s": "STOP"})],
        stop="STOP",
    ),
    Case("hermes-start-in-call", hs("tool_calls"), hermes(CALLS[:1])[len("<tool_call>") :], calls=CALLS[:1]),
    Case("hermes-no-tools", hs(tools=False), hermes(CALLS[:1]), content=hermes(CALLS[:1])),
    Case(
        "plain",
        ParserSpec("plain", "content", False, stop=("##",)),
        "\n\n</think> as text ## x",
        content="\n\n</think> as text ",
        stop="##",
    ),
    Case(
        "plain-reasoning",
        ParserSpec("plain", "reasoning", False),
        "\nr\n\n</think>\n\n<tool_call>c",
        "r",
        "<tool_call>c",
    ),
]


@dataclass
class Parsed:
    reasoning: str
    content: str
    calls: list[tuple[int, str, str, str]]  # (index, id, name, arguments text)
    stop: str | None
    stop_offset: int | None


def parse(spec: ParserSpec, chunks: list[str]) -> Parsed:
    parser = OutputParser(spec)
    segments: list[Segment] = []
    consumed, fed = 0, 0
    for chunk in chunks:
        segments += parser.feed(chunk)
        fed += len(chunk)
        assert consumed <= parser.num_consumed <= fed
        consumed = parser.num_consumed
    segments += parser.finish()
    total = sum(map(len, chunks))
    assert parser.num_consumed == (parser.stop_offset if parser.finished else total)
    reasoning, content = "", ""
    calls: list[tuple[int, str, str, str]] = []
    for seg in segments:
        if isinstance(seg, ToolCallStart):
            assert seg.index == len(calls), "tool calls start in order"
            calls.append((seg.index, seg.call_id, seg.name, ""))
        elif isinstance(seg, ToolCallArgs):
            assert seg.index == len(calls) - 1, "arguments belong to the latest call"
            index, call_id, name, args = calls[-1]
            calls[-1] = (index, call_id, name, args + seg.text)
        elif isinstance(seg, Reasoning):
            reasoning += seg.text
        else:
            content += seg.text
    assert parser.num_tool_calls == len(calls)
    return Parsed(reasoning, content, calls, parser.stop_sequence, parser.stop_offset)


def check(case: Case, got: Parsed) -> None:
    assert got.reasoning == case.reasoning
    assert got.content == case.content
    assert [(name, json.loads(args)) for _, _, name, args in got.calls] == case.calls
    for _, call_id, _, _ in got.calls:
        assert re.fullmatch(r"call_\d\d_[A-Za-z0-9]{24}", call_id)
    assert got.stop == case.stop
    # In every case the stop sequence's last occurrence is the one in content.
    assert got.stop_offset == (None if case.stop is None else case.text.rindex(case.stop))
    for marker in MARKERS:
        if marker not in case.reasoning + case.content:
            assert marker not in got.reasoning + got.content


def chunkings(text: str, seeds: int = 25) -> list[list[str]]:
    out = [[text], list(text)]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    for seed in range(seeds):
        rng, cuts = random.Random(seed), []
        i = 0
        while i < len(text):
            i += rng.randint(1, 12)
            cuts.append(i)
        out.append([text[a:b] for a, b in zip([0, *cuts], cuts, strict=False)])
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_any_chunking_gives_the_same_result(case: Case) -> None:
    whole = parse(case.spec, [case.text])
    check(case, whole)
    for chunks in chunkings(case.text):
        assert parse(case.spec, chunks) == whole, chunks


def test_ids_are_deterministic_per_seed_and_index() -> None:
    case = CASES[0]
    first = parse(case.spec, [case.text]).calls
    assert first == parse(case.spec, list(case.text)).calls
    other = parse(ParserSpec("deepseek", "reasoning", True, call_id_seed="other"), [case.text]).calls
    assert [c[1] for c in first] != [c[1] for c in other]
    assert [c[1][:8] for c in first] == ["call_00_", "call_01_", "call_02_"]


# -- golden: deepseek-recipe's parser fed the same chunks ----------------------------------------


def wheel_parse(case: Case, chunks: list[str]) -> tuple[str, str, list[tuple[str, Any]]]:
    dr = pytest.importorskip("deepseek_recipe")
    thinking = case.spec.start == "reasoning"
    body: dict[str, Any] = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "hi"}]}
    if not thinking:
        body["thinking"] = {"type": "disabled"}
    conv = dr.ChatCompletionRequest(body).convert(dr.ConversionOptions())
    options = dr.ParsingOptions(
        parse_tool_calls=case.spec.parse_tool_calls,
        starts_in_tool_calls=case.spec.start == "tool_calls",
        thinking_initial_stage=dr.ThinkingInitialStage.ReasoningStart if thinking else None,
        stop_sequences=list(case.spec.stop),
    )
    processor = dr.StreamProcessor(dr.ChatCompletionRequest.chunk_generator(conv, "id", "m"), options)
    events = list(processor.push(dr.InferenceChunk.ready()))
    for chunk in chunks:
        if processor.finished:
            break
        events += processor.push(dr.InferenceChunk.text(chunk, 1))
    if not processor.finished:
        events += processor.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop))
    reasoning, content = "", ""
    calls: dict[int, list[str]] = {}
    for event in events:
        for choice in json.loads(event.to_json())["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], ["", ""])
                entry[0] += tc.get("function", {}).get("name") or ""
                entry[1] += tc.get("function", {}).get("arguments") or ""
    return reasoning, content, [(name, json.loads(args)) for name, args in calls.values()]


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.spec.syntax == "deepseek" and c.golden], ids=lambda c: c.name
)
def test_deepseek_matches_deepseek_recipe(case: Case) -> None:
    splits = [[case.text[:i], case.text[i:]] for i in range(1, len(case.text), 7)]
    for chunks in [[case.text], list(case.text), *splits, *chunkings(case.text, seeds=3)[-3:]]:
        got = parse(case.spec, chunks)
        theirs = wheel_parse(case, chunks)
        assert (got.reasoning, got.content, [(n, json.loads(a)) for _, _, n, a in got.calls]) == theirs
