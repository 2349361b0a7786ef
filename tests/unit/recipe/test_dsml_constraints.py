"""DSML tool calls under a grammar: the constraint the gateway builds for a DeepSeek V4 / V4.1
conversation, compiled by xgrammar over the real DeepSeek V4 vocabulary, walked token by token.

What the renderer writes for a call (dsml.py, with the ``｜DSML｜`` token) is accepted to the end
of the output and parses back into the same call; what breaks a schema, names an unknown tool,
spells the markup from ordinary tokens or sneaks another special token into free text is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from libs.grammar.backend import GrammarError
from libs.grammar.completion import Alphabet, completion_path, next_steps
from libs.grammar.structure import load_structure, token_ids
from libs.grammar.xgrammar_backend import XGrammarBackend
from libs.models.tiny_deepseek import deepseek_v4_tokenizer_dir, write_tokenizer
from libs.protocol.codec import unpack_tokens
from libs.protocol.messages import StructuredOutput, StructuredOutputKind
from libs.recipe.chat_formats import DeepSeekChatFormat
from libs.recipe.constraints import structured_output
from libs.recipe.conversation import Conversation, Message, RecipeError, ToolCall, ToolDefinition
from libs.recipe.dsml import DSML, V4_DIALECT, V41_DIALECT, Dialect, Piece, tool_calls_block
from libs.recipe.dsml_values import admits_only_strings, raw_string_schema
from libs.recipe.grammar_markup import grammar_vocab_of
from libs.recipe.output_parser import OutputParser, ParserSpec
from libs.recipe.segments import ToolCallArgs, ToolCallStart
from libs.recipe.tokenizer import Tokenizer
from services.gateway.served_model import markup_token_ids

ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1},
        "unit": {"enum": ["C", "F"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city"],
}
WEATHER = ToolDefinition("weather", parameters=ARGS, strict=True)
CLOCK = ToolDefinition("clock")  # no parameters
LOOSE = ToolDefinition("search", parameters={"type": "object", "properties": {"q": {"type": "string"}}})
ASK = (Message("user", "hi"),)
VERSIONS = {"v4": V4_DIALECT, "v4.1": V41_DIALECT}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory, deepseek_v4_tokenizer_dir())  # V4 vocabulary + V4.1's markers
    return Tokenizer.from_hf_dir(directory)


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> XGrammarBackend:
    return XGrammarBackend(grammar_vocab_of(tokenizer, tokenizer.vocab_size))


def encode(tokenizer: Tokenizer, pieces: Sequence[Piece]) -> list[int]:
    """Pieces as the prompt encoder spells them: special pieces as their token, runs of text whole."""
    ids: list[int] = []
    text = ""
    for piece, special in pieces:
        if not special:
            text += piece
            continue
        ids += tokenizer.encode_plain(text) if text else []
        ids.append(tokenizer.special_id(piece))
        text = ""
    return ids + (tokenizer.encode_plain(text) if text else [])


class Walk:
    """One conversation's constraint, compiled, and a way to feed it token sequences."""

    def __init__(self, tokenizer: Tokenizer, backend: XGrammarBackend, version: str, conv: Conversation):
        self.tokenizer = tokenizer
        self.prompt = DeepSeekChatFormat(version, tokenizer).prompt(conv)  # type: ignore[arg-type]
        think_end = [tokenizer.special_id("</think>")]
        constraint = structured_output(
            conv,
            self.prompt,
            backend="xgrammar",
            reasoning_end=think_end,
            markup_ids=markup_token_ids(tokenizer),
        )
        assert constraint is not None and constraint.kind is StructuredOutputKind.STRUCTURE
        self.constraint = constraint
        self.compiled = backend.compile(constraint)
        self.eos = tokenizer.eos_token_id
        assert self.eos is not None

    def accepts(self, token_ids: Sequence[int], *, ends: bool = True) -> bool:
        """Whether every token is accepted (and, with ``ends``, EOS after them ends the output)."""
        matcher = self.compiled.matcher([self.eos])
        if not all(matcher.advance(t) for t in token_ids):
            return False
        return not ends or (matcher.advance(self.eos) and matcher.is_terminated())


def calls_block(dialect: Dialect, calls: Sequence[tuple[str, dict[str, object]]]) -> list[Piece]:
    tool_calls = [ToolCall(f"c{i}", name, json.dumps(args)) for i, (name, args) in enumerate(calls)]
    return tool_calls_block(tool_calls, dialect)


def parsed_calls(text: str, start: str) -> list[tuple[str, object]]:
    """The calls the output parser reads from ``text`` (name, arguments as JSON)."""
    parser = OutputParser(ParserSpec("deepseek", start, True))  # type: ignore[arg-type]
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for segment in [*parser.feed(text), *parser.finish()]:
        if isinstance(segment, ToolCallStart):
            names[segment.index] = segment.name
        elif isinstance(segment, ToolCallArgs):
            args[segment.index] = args.get(segment.index, "") + segment.text
    return [(names[i], json.loads(args.get(i, "{}"))) for i in sorted(names)]


@pytest.fixture(params=sorted(VERSIONS))
def version(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


def test_a_forced_call_is_the_rendered_block_and_parses_back(
    tokenizer: Tokenizer, backend: XGrammarBackend, version: str
) -> None:
    dialect = VERSIONS[version]
    conv = Conversation(ASK, tools=(WEATHER, CLOCK, LOOSE), tool_choice="required", thinking=False)
    walk = Walk(tokenizer, backend, version, conv)
    assert walk.prompt.start == "tool_calls" and walk.constraint.start_after == b""
    calls = [("weather", {"city": "Paris", "days": 3, "tags": ["a b", "</c>"]}), ("clock", {})]
    block = calls_block(dialect, calls)
    opening = encode(tokenizer, [*block[:3], ("\n", False)])  # the prompt ends with these
    assert walk.prompt.token_ids[-len(opening) :] == opening
    output = encode(tokenizer, block)[len(opening) :]
    assert walk.accepts(output)
    assert not walk.accepts(output[:-1])  # the block must close
    text = tokenizer.decode(output, skip_special_tokens=False)
    assert parsed_calls(text, "tool_calls") == calls
    # A non-strict tool still follows its schema when forced (as hermes' forced calls do).
    assert walk.accepts(encode(tokenizer, calls_block(dialect, [("search", {"q": "x"})]))[len(opening) :])


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("forecast", {"city": "Paris"}),  # no such tool
        ("weather", {"days": 3}),  # the required city is missing
        ("weather", {"city": "Paris", "days": "3"}),  # an integer as a raw string
        ("weather", {"city": "Paris", "days": 0}),  # below the minimum
        ("weather", {"city": "Paris", "unit": "K"}),  # not in the enum
        ("weather", {"days": 3, "city": "Paris"}),  # out of the declared order
        ("weather", {"city": "Paris", "wind": True}),  # not declared
        ("search", {"q": 5}),  # a string schema, given JSON
    ],
)
def test_a_forced_call_refuses_what_breaks_the_tools(
    tokenizer: Tokenizer, backend: XGrammarBackend, name: str, args: dict[str, object]
) -> None:
    conv = Conversation(ASK, tools=(WEATHER, CLOCK, LOOSE), tool_choice="required", thinking=False)
    walk = Walk(tokenizer, backend, "v4.1", conv)
    block = calls_block(V41_DIALECT, [(name, args)])
    opening = encode(tokenizer, [*block[:3], ("\n", False)])
    assert not walk.accepts(encode(tokenizer, block)[len(opening) :])


def test_the_markup_is_its_token_not_its_spelling(tokenizer: Tokenizer, backend: XGrammarBackend) -> None:
    conv = Conversation(ASK, tools=(WEATHER,), tool_choice="required", thinking=False)
    walk = Walk(tokenizer, backend, "v4.1", conv)
    block = calls_block(V41_DIALECT, [("weather", {"city": "Paris"})])
    body = block[4:]  # after the opening and its newline
    assert walk.accepts(encode(tokenizer, body))
    plain = tokenizer.encode_plain("".join(text for text, _ in body))  # ｜DSML｜ from ordinary tokens
    assert not walk.accepts(plain)
    # A raw string cannot hold the markup either, in either spelling.
    for inside in (f"a</{DSML} parameter>b", f"a{DSML}b"):
        sneaky = calls_block(V41_DIALECT, [("weather", {"city": inside})])[4:]
        assert not walk.accepts(encode(tokenizer, sneaky) + tokenizer.encode_plain(inside))


def test_strict_tools_under_auto_leave_text_free_and_constrain_a_block(
    tokenizer: Tokenizer, backend: XGrammarBackend, version: str
) -> None:
    dialect = VERSIONS[version]
    conv = Conversation(ASK, tools=(WEATHER, LOOSE), thinking=True)
    walk = Walk(tokenizer, backend, version, conv)
    assert walk.prompt.start == "reasoning"
    assert unpack_tokens(walk.constraint.start_after) == [tokenizer.special_id("</think>")]
    text = tokenizer.encode_plain("Let me check 中文 <b>.\n\n")
    assert walk.accepts(text)  # no call at all
    good = calls_block(dialect, [("weather", {"city": "Oslo", "unit": "C"}), ("search", {"any": [1]})])
    assert walk.accepts(text + encode(tokenizer, good))  # search is not strict: any parameters
    bad = calls_block(dialect, [("weather", {"city": "Oslo", "unit": "K"})])
    assert not walk.accepts(text + encode(tokenizer, bad))
    assert not walk.accepts(text + encode(tokenizer, good) + tokenizer.encode_plain("more"))  # the turn ends
    other_special = tokenizer.special_id(
        "<｜begin▁of▁sentence｜>"
    )  # special (V4 has its role tokens as text)
    assert not walk.accepts([*text, other_special], ends=False)
    decoded = tokenizer.decode(text + encode(tokenizer, good), skip_special_tokens=False)
    assert parsed_calls(decoded, "content") == [
        ("weather", {"city": "Oslo", "unit": "C"}),
        ("search", {"any": [1]}),
    ]


def test_a_format_beside_auto_tools_is_the_answer_or_a_block(
    tokenizer: Tokenizer, backend: XGrammarBackend, version: str
) -> None:
    dialect = VERSIONS[version]
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    conv = Conversation(
        ASK, tools=(WEATHER,), response_format="json_schema", response_schema=schema, thinking=False
    )
    walk = Walk(tokenizer, backend, version, conv)
    assert walk.accepts(tokenizer.encode_plain('{"answer": "sunny"}'))
    assert not walk.accepts(tokenizer.encode_plain('{"other": 1}'))
    assert not walk.accepts(tokenizer.encode_plain("It is sunny."))
    call = [("\n\n", False), *calls_block(dialect, [("weather", {"city": "Rome"})])]
    assert walk.accepts(encode(tokenizer, call))


def test_a_vocabulary_without_the_token_gets_literal_markup(
    tokenizer: Tokenizer, backend: XGrammarBackend
) -> None:
    conv = Conversation(ASK, tools=(WEATHER,), tool_choice="required", thinking=False)
    prompt = DeepSeekChatFormat("v4.1", tokenizer).prompt(conv)
    constraint = structured_output(conv, prompt, backend="xgrammar", reasoning_end=[1])
    assert constraint is not None and '"token"' not in constraint.spec and DSML in constraint.spec
    matcher = backend.compile(constraint).matcher([0])
    body = calls_block(V41_DIALECT, [("weather", {"city": "Paris"})])[4:]
    assert all(matcher.advance(t) for t in tokenizer.encode_plain("".join(text for text, _ in body)))


def test_outlines_refuses_dsml_calls(tokenizer: Tokenizer) -> None:
    from libs.grammar.outlines_backend import validate

    conv = Conversation(ASK, tools=(WEATHER,), tool_choice="required", thinking=False)
    prompt = DeepSeekChatFormat("v4.1", tokenizer).prompt(conv)
    constraint = structured_output(
        conv, prompt, backend="outlines", reasoning_end=[1], markup_ids=markup_token_ids(tokenizer)
    )
    assert constraint is not None
    with pytest.raises(GrammarError, match="special tokens"):
        validate(constraint)


def test_a_token_outside_the_vocabulary_is_refused(backend: XGrammarBackend) -> None:
    constraint = StructuredOutput(StructuredOutputKind.STRUCTURE, json.dumps({"token": 10**7}))
    with pytest.raises(GrammarError, match="outside the vocabulary"):
        backend.compile(constraint)


def test_the_tokenizer_fixture_has_the_markers(tokenizer: Tokenizer, tmp_path: Path) -> None:
    ids = markup_token_ids(tokenizer)
    assert {DSML, "<think>", "</think>"} <= set(ids)
    assert all(tokenizer.id_to_token(i) == spelling for spelling, i in ids.items())


def test_a_way_out_of_a_forced_call_goes_through_the_markup_token(
    tokenizer: Tokenizer, backend: XGrammarBackend
) -> None:
    """The worker's budget search (completion_path) finishes a call cut anywhere: it walks the
    DSML token where the markup needs it, and every step it offers leaves a way out."""
    conv = Conversation(ASK, tools=(WEATHER, CLOCK), tool_choice="required", thinking=False)
    walk = Walk(tokenizer, backend, "v4.1", conv)
    alphabet = Alphabet.of(grammar_vocab_of(tokenizer, tokenizer.vocab_size))
    markup = sorted(token_ids(load_structure(walk.constraint.spec, "xgrammar")))  # as the worker takes them
    assert markup == [tokenizer.special_id(DSML)]
    block = calls_block(V41_DIALECT, [("weather", {"city": "Paris", "days": 12, "tags": ["x"]})])
    output = encode(tokenizer, block[4:])
    for cut in range(0, len(output), 3):
        matcher = walk.compiled.matcher([walk.eos])
        assert all(matcher.advance(t) for t in output[:cut])
        path = completion_path(matcher, alphabet, walk.eos, markup_ids=markup)
        assert path is not None and path[-1] == walk.eos, cut
        assert walk.accepts([*output[:cut], *path[:-1]]), cut
        text = tokenizer.decode([*output[:cut], *path[:-1]], skip_special_tokens=False)
        (name, args), *_ = parsed_calls(text, "tool_calls")
        assert isinstance(args, dict)
        if "weather" in tokenizer.decode(output[:cut], skip_special_tokens=False):
            assert name == "weather" and isinstance(args["city"], str)
        else:
            assert name in ("weather", "clock")
        for token_id, rest in next_steps(path, alphabet, markup).items():
            assert walk.accepts([*output[:cut], token_id, *rest[:-1]]), (cut, token_id)
    # Inside nested JSON (a tool without parameters takes any): a way out from every point.
    conv = Conversation(ASK, tools=(CLOCK,), tool_choice="required", thinking=False)
    nested = Walk(tokenizer, backend, "v4.1", conv)
    deep = encode(tokenizer, calls_block(V41_DIALECT, [("clock", {"q": [[["a", {"b": [1]}]]]})])[4:])
    for cut in range(len(deep)):
        matcher = nested.compiled.matcher([nested.eos])
        assert all(matcher.advance(t) for t in deep[:cut])
        path = completion_path(matcher, alphabet, nested.eos, markup_ids=markup)
        assert path is not None and nested.accepts([*deep[:cut], *path[:-1]]), cut
    # Without the markup ids the search cannot take the token and finds no way out.
    matcher = walk.compiled.matcher([walk.eos])
    assert completion_path(matcher, alphabet, walk.eos) is None


INT = {"type": "integer"}


@pytest.mark.parametrize(
    ("schema", "raw", "json_form"),
    [
        ({"type": "string", "maxLength": 3}, {"type": "string", "maxLength": 3}, False),
        ({"type": ["string", "null"], "pattern": "^a"}, {"type": "string", "pattern": "^a"}, True),
        ({"anyOf": [INT, {"type": "null"}]}, None, True),  # pydantic's Optional[int]
        ({"oneOf": [INT, {"type": "boolean"}]}, None, True),
        ({"allOf": [INT]}, None, True),
        ({"$ref": "#/$defs/a"}, None, True),  # a -> b -> integer
        ({"anyOf": [{"type": "string", "enum": ["x"]}, INT]}, {"type": "string", "enum": ["x"]}, True),
        ({"anyOf": [{"type": "string"}, {"const": "y"}]}, {"type": "string"}, False),
        ({"enum": ["a", 1]}, {"type": "string", "enum": ["a"]}, True),
        ({}, {"type": "string"}, True),
        ({"properties": {"x": INT}}, None, True),  # untyped, but only an object has properties
    ],
)
def test_a_schema_decides_the_value_forms(schema: object, raw: object, json_form: bool) -> None:
    defs = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": INT}}
    assert raw_string_schema(schema, defs) == raw
    assert admits_only_strings(schema, defs) is not json_form


def test_string_limits_and_optional_values_follow_the_schema(
    tokenizer: Tokenizer, backend: XGrammarBackend
) -> None:
    args = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 12},
            "days": {"anyOf": [INT, {"type": "null"}]},
        },
        "required": ["city", "days"],
    }
    conv = Conversation(
        ASK, tools=(ToolDefinition("w", parameters=args),), tool_choice="required", thinking=False
    )
    walk = Walk(tokenizer, backend, "v4.1", conv)
    for args_ok in ({"city": "P", "days": 3}, {"city": "Paris", "days": None}):
        assert walk.accepts(encode(tokenizer, calls_block(V41_DIALECT, [("w", args_ok)])[4:]))
    for args_bad in ({"city": "", "days": 3}, {"city": "a" * 13, "days": 3}, {"city": "P", "days": "3"}):
        assert not walk.accepts(encode(tokenizer, calls_block(V41_DIALECT, [("w", args_bad)])[4:]))


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": {"a": INT}, "required": 5},
        {"type": "object", "properties": {"a": INT}, "required": [["a"]]},
        {"type": "object", "properties": {'a"b': INT}},
        {"type": "object", "properties": {"a\nb": INT}},
        {"type": "object", "properties": {f"a{DSML}": INT}},
    ],
)
def test_a_tool_dsml_cannot_spell_is_a_client_error(tokenizer: Tokenizer, parameters: object) -> None:
    conv = Conversation(
        ASK, tools=(ToolDefinition("w", parameters=parameters),), tool_choice="required", thinking=False
    )
    prompt = DeepSeekChatFormat("v4.1", tokenizer).prompt(conv)
    with pytest.raises(RecipeError) as err:
        structured_output(conv, prompt, backend="xgrammar", reasoning_end=[1])
    assert err.value.param == "tools"
