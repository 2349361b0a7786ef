"""The Matcher contract on both backends over the real SmolLM2 vocabulary: the bit layout, stop
tokens (several ids), rejection, rollback, and each constraint kind: JSON, REGEX, prefix/suffix
around a schema (a forced tool call), TOOL_TRIGGERS (xgrammar)."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from libs.grammar import BACKENDS, make_backend
from libs.grammar.backend import GrammarError, Matcher
from libs.grammar.cache import GrammarCache
from libs.protocol.messages import StructuredOutput, StructuredOutputKind
from libs.recipe.tokenizer import Tokenizer
from tests.unit.grammar.walk import WalkVocab, allowed_ids, assert_json_style, new_bitmask, walk

ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CALL_PREFIX = '<tool_call>\n{"name": "get_weather", "arguments": '
CALL_SUFFIX = "}\n</tool_call>"
VOCAB_SIZE = 49152  # SmolLM2's logits width: the length of the vocab fixture


def schema_constraint(
    backend: str, schema: object = ARGS, prefix: str = "", suffix: str = ""
) -> StructuredOutput:
    return StructuredOutput(
        StructuredOutputKind.JSON_SCHEMA, json.dumps(schema), backend, prefix=prefix, suffix=suffix
    )


def regex_constraint(backend: str, pattern: str) -> StructuredOutput:
    return StructuredOutput(StructuredOutputKind.REGEX, pattern, backend)


def mask(matcher: Matcher) -> set[int]:
    bitmask = new_bitmask(VOCAB_SIZE)
    matcher.fill_mask(bitmask, 0)
    return set(allowed_ids(bitmask).tolist())


def feed(matcher: Matcher, token_ids: list[int]) -> None:
    for token_id in token_ids:
        assert matcher.advance(token_id), token_id


def text_of(walk_vocab: WalkVocab, token_ids: list[int], stop_ids: tuple[int, ...]) -> str:
    assert token_ids[-1] in stop_ids
    return walk_vocab.text(token_ids[:-1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bit_layout_and_row(backend: str, caches: dict[str, GrammarCache], vocab: list[bytes]) -> None:
    compiled = caches[backend].get(regex_constraint(backend, "(ab|cd)"))
    bitmask = torch.full((3, len(vocab) // 32), -1, dtype=torch.int32)
    compiled.matcher([2]).fill_mask(bitmask, 1)
    expected = {
        t for t, text in enumerate(vocab) if text and (b"ab".startswith(text) or b"cd".startswith(text))
    }
    assert set(allowed_ids(bitmask, 1).tolist()) == expected
    assert bool((bitmask[0] == -1).all()) and bool((bitmask[2] == -1).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_bits_past_the_vocabulary_stay_clear(backend: str, vocab: list[bytes]) -> None:
    small = [*vocab[:1000], b"", b"", b""]  # 1003 ids: the last word is part padding
    string = schema_constraint(backend, {"type": "string"})
    matcher = make_backend(backend, small).compile(string).matcher([1001])
    for text in (b'"', b"a", b'"', None):  # inside the string nearly every token is allowed
        bitmask = torch.full((1, 32), -1, dtype=torch.int32)
        matcher.fill_mask(bitmask, 0)
        allowed = set(allowed_ids(bitmask).tolist())
        assert max(allowed) < len(small) and len(allowed) > (len(small) // 2 if text == b"a" else 0)
        if text is not None:
            assert matcher.advance(small.index(text))
    assert allowed == {1001}


@pytest.mark.parametrize("backend", BACKENDS)
def test_stop_tokens(
    backend: str, caches: dict[str, GrammarCache], tokenizer: Tokenizer, stop_ids: tuple[int, ...]
) -> None:
    compiled = caches[backend].get(schema_constraint(backend))
    matcher = compiled.matcher(stop_ids)
    feed(matcher, tokenizer.encode_plain('{"city": "Oslo", "unit": "c"'))
    assert not mask(matcher) & set(stop_ids)
    assert not matcher.advance(stop_ids[1])
    feed(matcher, tokenizer.encode_plain("}"))
    assert mask(matcher) == set(stop_ids)  # only the stops
    assert matcher.advance(stop_ids[2]) and matcher.is_terminated()
    assert not matcher.advance(stop_ids[0]) and not matcher.advance(tokenizer.encode_plain("x")[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stop_id_that_is_also_text_only_stops(
    backend: str, caches: dict[str, GrammarCache], tokenizer: Tokenizer
) -> None:
    newline = tokenizer.encode_plain("\n")[0]
    stops = [2, newline]
    matcher = caches[backend].get(regex_constraint(backend, "a(\nb)?")).matcher(stops)
    assert newline not in mask(matcher)
    feed(matcher, tokenizer.encode_plain("a"))
    assert mask(matcher) == set(stops)
    assert matcher.advance(newline) and matcher.is_terminated()


@pytest.mark.parametrize("backend", BACKENDS)
def test_rejected_token_leaves_the_state(
    backend: str, caches: dict[str, GrammarCache], tokenizer: Tokenizer, stop_ids: tuple[int, ...]
) -> None:
    matcher = caches[backend].get(schema_constraint(backend)).matcher(stop_ids)
    feed(matcher, tokenizer.encode_plain('{"city": "'))
    before = mask(matcher)
    for token_id in [*tokenizer.encode_plain("}]"), stop_ids[0], 49151, 10**6]:
        if token_id not in before:
            assert not matcher.advance(token_id)
    assert mask(matcher) == before
    feed(matcher, tokenizer.encode_plain('Rome", "unit": "f"}'))
    assert matcher.advance(stop_ids[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollback(
    backend: str,
    caches: dict[str, GrammarCache],
    walk_vocab: WalkVocab,
    stop_ids: tuple[int, ...],
) -> None:
    compiled = caches[backend].get(schema_constraint(backend))
    token_ids = walk(compiled.matcher(stop_ids), walk_vocab, stop_ids, random.Random(3), finish_after=8)
    matcher = compiled.matcher(stop_ids)
    masks = []
    for token_id in token_ids:
        masks.append(mask(matcher))
        assert matcher.advance(token_id)
    assert matcher.is_terminated()
    matcher.rollback(1)  # the stop token
    assert not matcher.is_terminated() and mask(matcher) == masks[-1]
    matcher.rollback(5)
    assert mask(matcher) == masks[-6]
    feed(matcher, token_ids[-6:])
    assert matcher.is_terminated()
    with pytest.raises(ValueError):
        matcher.rollback(len(token_ids) + 1)
    matcher.rollback(len(token_ids))
    assert mask(matcher) == masks[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", ["[a-z]+( [a-z]+)*", "-?[0-9]+(\\.[0-9]+)?", "(yes|no|maybe)!?"])
def test_regex_walks_match(
    backend: str,
    pattern: str,
    caches: dict[str, GrammarCache],
    walk_vocab: WalkVocab,
    stop_ids: tuple[int, ...],
) -> None:
    compiled = caches[backend].get(regex_constraint(backend, pattern))
    for seed in range(3):
        token_ids = walk(
            compiled.matcher(stop_ids), walk_vocab, stop_ids, random.Random(seed), finish_after=12
        )
        assert re.fullmatch(pattern, text_of(walk_vocab, token_ids, stop_ids))


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_continues_past_a_point_where_it_may_end(
    backend: str, caches: dict[str, GrammarCache], tokenizer: Tokenizer, stop_ids: tuple[int, ...]
) -> None:
    matcher = caches[backend].get(regex_constraint(backend, "-?[0-9]+(\\.[0-9]+)?")).matcher(stop_ids)
    feed(matcher, tokenizer.encode_plain("1"))
    assert set(stop_ids) <= mask(matcher)
    feed(matcher, tokenizer.encode_plain(".5"))
    assert matcher.advance(stop_ids[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_object(
    backend: str, caches: dict[str, GrammarCache], walk_vocab: WalkVocab, stop_ids: tuple[int, ...]
) -> None:
    compiled = caches[backend].get(StructuredOutput(StructuredOutputKind.JSON, "", backend))
    for seed in range(3):
        token_ids = walk(compiled.matcher(stop_ids), walk_vocab, stop_ids, random.Random(seed))
        text = text_of(walk_vocab, token_ids, stop_ids)
        assert_json_style(text)
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_and_suffix_around_a_schema(
    backend: str, caches: dict[str, GrammarCache], walk_vocab: WalkVocab, stop_ids: tuple[int, ...]
) -> None:
    constraint = schema_constraint(backend, prefix=CALL_PREFIX, suffix=CALL_SUFFIX)
    compiled = caches[backend].get(constraint)
    for seed in range(2):
        token_ids = walk(compiled.matcher(stop_ids), walk_vocab, stop_ids, random.Random(seed))
        text = text_of(walk_vocab, token_ids, stop_ids)
        assert text.startswith(CALL_PREFIX) and text.endswith(CALL_SUFFIX)
        arguments = text[len(CALL_PREFIX) : -len(CALL_SUFFIX)]
        assert_json_style(arguments)
        jsonschema.validate(json.loads(arguments), ARGS)


def tool_triggers(backend: str) -> StructuredOutput:
    tag = {"begin": CALL_PREFIX, "schema": ARGS, "end": CALL_SUFFIX}
    spec = json.dumps({"triggers": ["<tool_call>"], "tags": [tag]})
    return StructuredOutput(StructuredOutputKind.TOOL_TRIGGERS, spec, backend)


def test_tool_triggers(
    caches: dict[str, GrammarCache], tokenizer: Tokenizer, walk_vocab: WalkVocab, stop_ids: tuple[int, ...]
) -> None:
    compiled = caches["xgrammar"].get(tool_triggers("xgrammar"))
    matcher = compiled.matcher(stop_ids)
    assert set(stop_ids) <= mask(matcher)  # free text may end at once
    feed(matcher, tokenizer.encode_plain("Let me check the weather. "))
    assert set(stop_ids) <= mask(matcher)
    feed(matcher, tokenizer.encode_plain("<tool_call>"))
    assert not mask(matcher) & set(stop_ids)  # inside a call: no stopping
    assert not matcher.advance(tokenizer.encode_plain("hello")[0])
    rest = walk(matcher, walk_vocab, stop_ids, random.Random(0), finish_after=0)
    text = "Let me check the weather. <tool_call>" + text_of(walk_vocab, rest, stop_ids)
    start = text.index(CALL_PREFIX) + len(CALL_PREFIX)
    arguments = text[start : text.index(CALL_SUFFIX, start)]  # free text may follow the call
    assert_json_style(arguments)
    jsonschema.validate(json.loads(arguments), ARGS)


def call_or_format(backend: str) -> StructuredOutput:
    tag = {"begin": CALL_PREFIX, "schema": ARGS, "end": CALL_SUFFIX}
    fmt = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    spec = json.dumps({"format": {"schema": fmt}, "tags": [tag]})
    return StructuredOutput(StructuredOutputKind.CALL_OR_FORMAT, spec, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_call_or_format_is_one_or_the_other(
    backend: str,
    seed: int,
    caches: dict[str, GrammarCache],
    tokenizer: Tokenizer,
    walk_vocab: WalkVocab,
    stop_ids: tuple[int, ...],
) -> None:
    compiled = caches[backend].get(call_or_format(backend))
    matcher = compiled.matcher(stop_ids)
    assert not mask(matcher) & set(stop_ids)  # an empty output is neither
    assert not matcher.advance(tokenizer.encode_plain("Sure")[0])  # free text is neither
    rest = walk(matcher, walk_vocab, stop_ids, random.Random(seed), finish_after=0)
    text = text_of(walk_vocab, rest, stop_ids)
    if text.startswith("<tool_call>"):
        assert text.startswith(CALL_PREFIX) and text.endswith(CALL_SUFFIX), text
        jsonschema.validate(json.loads(text[len(CALL_PREFIX) : -len(CALL_SUFFIX)]), ARGS)
    else:
        assert json.loads(text).keys() == {"answer"}, text
    # both ways are open from the start
    for opening in ("<tool_call>", '{"answer'):
        probe = compiled.matcher(stop_ids)
        feed(probe, tokenizer.encode_plain(opening))


def test_outlines_cannot_do_tool_triggers(caches: dict[str, GrammarCache]) -> None:
    with pytest.raises(GrammarError, match="tool triggers"):
        caches["outlines"].get(tool_triggers("outlines"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_matcher_needs_a_stop_token(backend: str, caches: dict[str, GrammarCache]) -> None:
    compiled = caches[backend].get(regex_constraint(backend, "(ab|cd)"))
    with pytest.raises(ValueError):
        compiled.matcher([])


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_refuses_another_backends_constraint(backend: str, caches: dict[str, GrammarCache]) -> None:
    other = next(name for name in BACKENDS if name != backend)
    with pytest.raises(GrammarError, match=other):
        caches[backend].backend.compile(regex_constraint(other, "a"))


def test_outlines_cannot_write_nul(caches: dict[str, GrammarCache]) -> None:
    with pytest.raises(GrammarError, match="NUL"):
        caches["outlines"].get(schema_constraint("outlines", prefix="\x00"))
    with pytest.raises(GrammarError, match="NUL"):
        caches["outlines"].get(schema_constraint("outlines", {"const": "a\x00"}))
