"""OutputParser edge cases: holdback, stop sequences, unterminated and malformed tool calls, fuzzing."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import pytest

from libs.recipe.output_parser import OutputParser, ParserSpec, tool_call_id
from libs.recipe.segments import Content, Reasoning, Segment, ToolCallArgs, ToolCallStart

DS_CONTENT = ParserSpec("deepseek", "content", True)
HERMES = ParserSpec("hermes", "content", True)


def run(spec: ParserSpec, *chunks: str) -> list[Segment]:
    parser = OutputParser(spec)
    out = [seg for chunk in chunks for seg in parser.feed(chunk)]
    return out + parser.finish()


def summary(segments: list[Segment]) -> dict[str, Any]:
    """Concatenated reasoning and content, and per call (name, arguments text)."""
    got: dict[str, Any] = {"reasoning": "", "content": "", "calls": []}
    for seg in segments:
        if isinstance(seg, Reasoning):
            got["reasoning"] += seg.text
        elif isinstance(seg, Content):
            got["content"] += seg.text
        elif isinstance(seg, ToolCallStart):
            got["calls"].append([seg.name, ""])
        elif isinstance(seg, ToolCallArgs):
            got["calls"][seg.index][1] += seg.text
    return got


def test_partial_markers_are_held_back_and_released() -> None:
    parser = OutputParser(ParserSpec("deepseek", "reasoning", True, stop=("STOP",)))
    assert parser.feed("abc</th") == [Reasoning("abc")]
    assert parser.num_consumed == 3
    assert parser.feed("ink>\n\nx\n\n") == [Content("x")]  # newlines may still precede <｜DSML｜
    assert parser.num_consumed == 14
    assert parser.feed("<｜DSM") == []
    assert parser.feed("y ST") == [Content("\n\n<｜DSMy ")]
    assert parser.feed("OP z") == []
    assert (parser.finished, parser.stop_sequence, parser.stop_offset, parser.num_consumed) == (
        True,
        "STOP",
        23,
        23,
    )
    assert parser.feed("more") == [] and parser.finish() == []


def test_finish_flushes_the_stash_with_the_stage_action() -> None:
    parser = OutputParser(DS_CONTENT)
    assert (parser.feed("abc</thi"), parser.finish()) == ([Content("abc")], [Content("</thi")])
    assert summary(run(ParserSpec("deepseek", "reasoning", True), "r\n\n"))["reasoning"] == "r\n\n"


def test_stop_sequences_only_apply_to_content() -> None:
    spec = ParserSpec("hermes", "reasoning", True, stop=("X",))
    got = summary(run(spec, 'aXb</think><tool_call>{"name": "X", "arguments": {"X": "X"}}</tool_call>cXd'))
    assert got == {"reasoning": "aXb", "content": "c", "calls": [["X", '{"X": "X"}']]}


def test_non_json_string_false_values_become_json_strings() -> None:
    block = '<｜DSML｜ invoke name="f">\n' + "".join(
        f'<｜DSML｜ parameter name="{k}" string="false">{v}</｜DSML｜ parameter>\n'
        for k, v in [("a", "not json"), ("b", "NaN"), ("c", ' {"x": [1, 2]} '), ("d", ""), ("e", "1e5")]
    )
    args = summary(run(DS_CONTENT, block + "</｜DSML｜ invoke>"))["calls"][0][1]
    assert json.loads(args) == {"a": "not json", "b": "NaN", "c": {"x": [1, 2]}, "d": "", "e": 1e5}


def test_unterminated_deepseek_calls() -> None:
    head = '<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="'
    # Like deepseek-recipe: the call stays, with the arguments that streamed (held text included).
    assert summary(run(DS_CONTENT, head + 'true">abc</｜DS'))["calls"] == [["f", '{"a": "abc</｜DS']]
    assert summary(run(DS_CONTENT, head + 'false">[1, 2'))["calls"] == [["f", '{"a": "[1, 2"']]
    # A name that never closed is no call.
    assert summary(run(DS_CONTENT, 'x<｜DSML｜ invoke name="get_wea')) == {
        "reasoning": "",
        "content": "x",
        "calls": [],
    }


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        # Not a call at all: the text is content, and parsing goes on after the opener.
        ("Use the <tool_call> tag.", "Use the <tool_call> tag.", []),
        ('A\n<tool_call>{"arguments": {}}</tool_call>B', 'A\n<tool_call>{"arguments": {}}</tool_call>B', []),
        ('<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": 3}</tool_call>', []),
        ('<tool_call><tool_call>{"name": "f"}</tool_call>', "<tool_call>", [["f", "{}"]]),
        # The output ends before the name is known: content too.
        ('<tool_call>\n{"arguments": {"a": 1}, "na', '<tool_call>\n{"arguments": {"a": 1}, "na', []),
        # Once named, a call stays a call: truncated arguments are what streamed.
        ('<tool_call>{"name": "f", "arguments": {"a": [1, "x', "", [["f", '{"a": [1, "x']]),
        ('<tool_call>{"name": "f", "argu', "", [["f", ""]]),
        # Best effort after the name: a missing outer brace, a bad character inside the arguments.
        ('<tool_call>{"name": "f", "arguments": {"a": 1}\n</tool_call>ok', "ok", [["f", '{"a": 1}']]),
        ('<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>ok', "ok", [["f", '{"a": 1']]),
        # Other shapes of arguments.
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [["f", '{"a": 1}']]),
        ('<tool_call>{"name": "f", "arguments": null}</tool_call>', "", [["f", "{}"]]),
        (
            '<tool_call>{"id": [1, {"}": 2}], "name": "f", "parameters": {"b": 2}, "x": "y"}</tool_call>',
            "",
            [["f", '{"b": 2}']],
        ),
        # Two calls without a closing tag between them; text between calls is content.
        (
            '<tool_call>{"name": "f"}\n<tool_call>{"name": "g"}</tool_call>\n\nmid\n<tool_call>{"name": "h"}',
            "mid",
            [["f", "{}"], ["g", "{}"], ["h", "{}"]],
        ),
    ],
)
def test_hermes_malformed_calls(text: str, content: str, calls: list[list[str]]) -> None:
    for chunks in ([text], list(text)):
        assert summary(run(HERMES, *chunks)) == {"reasoning": "", "content": content, "calls": calls}


def test_hermes_think_only_at_the_start_and_calls_from_reasoning() -> None:
    assert summary(run(HERMES, "\n<think>r</think>\n\nc <think>x")) == {
        "reasoning": "r",
        "content": "c <think>x",
        "calls": [],
    }
    got = summary(run(HERMES, '<think>r\n<tool_call>{"name": "f", "arguments": {}}</tool_call>after'))
    assert got == {"reasoning": "r", "content": "after", "calls": [["f", "{}"]]}


def test_hermes_pending_call_is_not_consumed_until_named() -> None:
    parser = OutputParser(HERMES)
    assert parser.feed('hi <tool_call>{"arguments": {"a": 1}, ') == [Content("hi ")]
    assert parser.num_consumed == len("hi <tool_call>")
    out = parser.feed('"name": "f"}')
    assert out == [ToolCallStart(0, tool_call_id("", 0), "f"), ToolCallArgs(0, '{"a": 1}')]
    assert parser.num_consumed == len('hi <tool_call>{"arguments": {"a": 1}, "name": "f"}')


def test_plain_is_verbatim_and_spec_is_checked() -> None:
    assert run(ParserSpec("plain", "content", False), "\n<｜DSML｜</think>") == [
        Content("\n<｜DSML｜</think>")
    ]
    with pytest.raises(ValueError):
        ParserSpec("plain", "tool_calls", True)
    with pytest.raises(ValueError):
        ParserSpec("deepseek", "tool_calls", False)


SOUP = {
    "deepseek": [
        '<｜DSML｜ parameter name="k" string="true">',
        '<｜DSML｜parameter name="n" string="false">',
        "</｜DSML｜ parameter>",
        "</｜DSML｜ invoke>",
        '<｜DSML｜ invoke name="f">',
        "<｜DSML｜",
        " calls>",
        "tool_calls>",
        'invoke name="',
        '"',
        '">',
        'string="true">',
        "</｜DSML｜",
        "</think>",
        "\n",
        "\n\n",
        "a",
        "中",
        "😀",
        "｜",
        "END",
        "1",
        " ",
        '"x"',
        '[1, {"a": 2}]',
        "\\",
    ],
    "hermes": [
        "<tool_call>",
        "</tool_call>",
        "<think>",
        "</think>",
        '{"name": "f", "arguments": ',
        '{"arguments": ',
        '"name": "g"}',
        "{",
        "}",
        "[",
        "]",
        '"',
        "\\",
        ":",
        ",",
        " ",
        "\n",
        "a",
        "中",
        "😀",
        "END",
        "<",
        "1",
        "null",
        '"s\\"}"',
    ],
}


def soup(rng: random.Random, syntax: str) -> str:
    return "".join(rng.choice(SOUP[syntax]) for _ in range(rng.randint(1, 40)))


@pytest.mark.parametrize("syntax", ["deepseek", "hermes"])
def test_random_markup_is_chunking_invariant(syntax: str) -> None:
    for seed in range(300):
        rng = random.Random(seed)
        text = soup(rng, syntax)
        start: Any = rng.choice(["reasoning", "content", "tool_calls"])
        spec = ParserSpec(syntax, start, True, stop=rng.choice([(), ("END",), ("\n\n",)]))  # type: ignore[arg-type]
        whole = run(spec, text)
        cuts = (
            sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8))))
            if len(text) > 1
            else []
        )
        for chunks in (list(text), [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]):
            assert summary(run(spec, *chunks)) == summary(whole), (seed, text, chunks)


def test_random_deepseek_markup_matches_deepseek_recipe() -> None:
    """Reasoning, content and tool names match the wheel; arguments wherever the wheel's are JSON.

    Known, deliberate differences are kept out of the soup: a parameter name ends at its closing
    quote (the wheel ends it at the next space), and a bare "<" right before newlines and a marker
    (the wheel then keeps one of the newlines the marker should drop).
    """
    dr = pytest.importorskip("deepseek_recipe")
    for seed in range(150):
        rng = random.Random(seed)
        text = soup(rng, "deepseek")
        start = rng.choice(["reasoning", "content", "tool_calls"])
        spec = ParserSpec("deepseek", start, True, stop=rng.choice([(), ("END",)]))  # type: ignore[arg-type]
        body: dict[str, Any] = {
            "model": "DeepSeek-V4.1-Flash",
            "messages": [{"role": "user", "content": "hi"}],
        }
        if start != "reasoning":
            body["thinking"] = {"type": "disabled"}
        options = dr.ParsingOptions(
            starts_in_tool_calls=start == "tool_calls",
            stop_sequences=list(spec.stop),
            thinking_initial_stage=dr.ThinkingInitialStage.ReasoningStart if start == "reasoning" else None,
        )
        conv = dr.ChatCompletionRequest(body).convert(dr.ConversionOptions())
        processor = dr.StreamProcessor(dr.ChatCompletionRequest.chunk_generator(conv, "id", "m"), options)
        events = list(processor.push(dr.InferenceChunk.text(text, 1)))
        if not processor.finished:
            events += processor.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop))
        theirs: dict[str, Any] = {"reasoning": "", "content": "", "calls": []}
        for event in events:
            for choice in json.loads(event.to_json())["choices"]:
                delta = choice["delta"]
                theirs["reasoning"] += delta.get("reasoning_content") or ""
                theirs["content"] += delta.get("content") or ""
                for tc in delta.get("tool_calls") or []:
                    if "id" in tc:
                        theirs["calls"].append([tc["function"]["name"], ""])
                    theirs["calls"][tc["index"]][1] += tc["function"].get("arguments") or ""
        ours = summary(run(spec, text))
        assert [ours["reasoning"], ours["content"]] == [theirs["reasoning"], theirs["content"]], (seed, text)
        assert [c[0] for c in ours["calls"]] == [c[0] for c in theirs["calls"]], (seed, text)
        for (_, our_args), (_, their_args) in zip(ours["calls"], theirs["calls"], strict=True):
            try:
                expected = json.loads(their_args)
            except json.JSONDecodeError:
                continue
            assert json.loads(our_args) == expected, (seed, text)


def test_work_is_linear_in_the_output() -> None:
    value = ('x"\\\n中😀 ' * 4000)[:20000]
    call = '<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="v" string="true">'
    call += value + "</｜DSML｜ parameter>"
    text = "r" * 20000 + "</think>" + "c\n" * 10000 + "\n" * 20000 + call
    began = time.perf_counter()
    parser = OutputParser(ParserSpec("deepseek", "reasoning", True, stop=("never seen",)))
    out = [seg for i in range(0, len(text), 4) for seg in parser.feed(text[i : i + 4])]
    out += parser.finish()
    assert time.perf_counter() - began < 5  # about 0.2 s; a quadratic rescan takes minutes
    got = summary(out)
    assert got["content"] == "c\n" * 9999 + "c" and json.loads(got["calls"][0][1] + "}") == {"v": value}
