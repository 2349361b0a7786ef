"""STRUCTURE constraints: the spec's checks, free text that excludes strings, and special tokens
reached only by a token node (tests/unit/recipe/test_dsml_constraints.py walks real DSML calls)."""

from __future__ import annotations

import json
import random

import pytest
import torch
import xgrammar as xgr

from libs.grammar.backend import SPECIAL_BYTES, GrammarError
from libs.grammar.outlines_backend import make_vocabulary
from libs.grammar.structure import MAX_NODES, After, Lit, RawString, Text, Token, load_structure, triggers
from libs.grammar.xgrammar_backend import XGrammarBackend, excluding_grammar, validate
from libs.protocol.messages import StructuredOutput, StructuredOutputKind

# Tokens: a few letters and pieces, two special tokens (4, 5), a stop token (6).
VOCAB = [b"a", b"b", b"<", b"</", SPECIAL_BYTES, SPECIAL_BYTES, b"", b">", b"ab", b'"', b"1", b"\xff"]
STOP = 6


def structure(tree: object) -> StructuredOutput:
    return StructuredOutput(StructuredOutputKind.STRUCTURE, json.dumps(tree))


def accepts(backend: XGrammarBackend, tree: object, token_ids: list[int], ends: bool = True) -> bool:
    matcher = backend.compile(structure(tree)).matcher([STOP])
    if not all(matcher.advance(t) for t in token_ids):
        return False
    return not ends or matcher.advance(STOP)


@pytest.fixture(scope="module")
def backend() -> XGrammarBackend:
    return XGrammarBackend(VOCAB)


def test_a_special_token_only_where_a_token_node_names_it(backend: XGrammarBackend) -> None:
    tree = {"seq": [{"lit": "<"}, {"token": 4}, {"lit": ">"}, {"text": True}]}
    assert accepts(backend, tree, [2, 4, 7, 0, 8])
    assert not accepts(backend, tree, [2, 5], ends=False)  # the other special token
    assert not accepts(backend, tree, [2, 11], ends=False)  # an ordinary token with the same byte
    assert not accepts(backend, tree, [2, 4, 7, 0, 4], ends=False)  # not in free text
    for text_node in ({"json": {"type": "string"}}, {"regex": ".*"}, {"string": {"type": "string"}}):
        assert not accepts(backend, {"seq": [{"lit": "a"}, text_node]}, [0, 9, 4], ends=False)


def test_after_a_trigger_the_rest_must_follow_and_ends_the_output(backend: XGrammarBackend) -> None:
    tree = {"after": {"token": 4}, "then": {"seq": [{"json": {"type": "integer"}}, {"lit": ">"}]}}
    assert accepts(backend, tree, [0, 8, 2])  # no trigger: all free text
    assert accepts(backend, tree, [0, 8, 4, 10, 7])
    assert not accepts(backend, tree, [0, 4, 0], ends=False)
    assert not accepts(backend, tree, [4, 10, 7, 0], ends=False)  # nothing after it
    literal = {"after": {"lit": "</"}, "then": {"lit": "b>"}, "excludes": ["ab"]}
    assert accepts(backend, literal, [0, 3, 1, 7]) and accepts(backend, literal, [0, 2, 1, 7])
    assert not accepts(backend, literal, [8], ends=False)  # excluded from the free text
    assert not accepts(backend, literal, [0, 1], ends=False)  # "ab" spelled from two tokens


def test_raw_strings_follow_their_string_schema(backend: XGrammarBackend) -> None:
    enum = {"seq": [{"string": {"enum": ["ab", "b"]}}, {"token": 4}]}
    assert (
        accepts(backend, enum, [8, 4])
        and accepts(backend, enum, [0, 1, 4])
        and accepts(backend, enum, [1, 4])
    )
    assert not accepts(backend, enum, [0, 4], ends=False)
    pattern = {"seq": [{"string": {"type": "string", "pattern": "^a+$"}}, {"token": 4}]}
    assert accepts(backend, pattern, [0, 0, 4]) and not accepts(backend, pattern, [1], ends=False)
    lengths = {"seq": [{"string": {"type": "string", "maxLength": 2}}, {"token": 4}]}
    assert accepts(backend, lengths, [8, 4]) and not accepts(backend, lengths, [8, 0], ends=False)
    free = {"seq": [{"string": {"type": "string"}, "excludes": ["b<"]}, {"token": 4}]}
    assert accepts(backend, free, [0, 2, 0, 4]) and not accepts(backend, free, [1, 2], ends=False)


@pytest.mark.parametrize("words", [["｜DSML｜"], ["ab", "xabc"], ["aa"], ["a]b", "^-", "\\"]])
def test_excluding_grammar_matches_exactly_the_texts_without_the_words(words: list[str]) -> None:
    alphabet = sorted(set("".join(words)) | {"x", "y"})
    vocab = [ch.encode() for ch in alphabet]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab))
    compiled = xgr.GrammarCompiler(info).compile_grammar(xgr.Grammar.from_ebnf(excluding_grammar(words)))
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10)))
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        assert matcher.accept_string(text) == (not any(w in text for w in words)), text


@pytest.mark.parametrize(
    ("tree", "where"),
    [
        ([1], "structure"),
        ({"lit": "a", "token": 1}, "structure"),
        ({"lit": 1}, "structure.lit"),
        ({"token": -1}, "structure.token"),
        ({"token": True}, "structure.token"),
        ({"seq": []}, "structure.seq"),
        ({"or": [{"lit": "a"}, {"nope": 1}]}, "structure.or[1]"),
        ({"lit": "a", "excludes": ["x"]}, "structure"),
        ({"text": True, "excludes": [""]}, "structure.excludes"),
        ({"text": 1}, "structure.text"),
        ({"after": {"json": {}}, "then": {"lit": "a"}}, "structure"),
        ({"after": {"lit": ""}, "then": {"lit": "a"}}, "structure"),
        ({"json": {"type": "object", "minProperties": "x"}}, "structure.json"),
        ({"string": {"type": "integer"}}, "structure.string"),
        ({"string": {"enum": ["a", 1]}}, "structure.string"),
        ({"seq": [{"lit": "a"}] * (MAX_NODES + 1)}, "structure.seq"),
    ],
)
def test_a_bad_structure_is_refused_and_named(tree: object, where: str) -> None:
    with pytest.raises(GrammarError) as err:
        load_structure(json.dumps(tree), "xgrammar")
    assert err.value.param is not None and err.value.param.startswith(where), err.value.param


def test_the_loaded_tree_and_its_triggers() -> None:
    tree = load_structure(
        json.dumps({"after": {"token": 3}, "then": {"string": {"type": "string"}, "excludes": ["x"]}}),
        "xgrammar",
    )
    assert tree == After(Token(3), RawString(None, None, ("x",)))
    assert triggers(tree) == [Token(3)]
    assert load_structure('{"text": true}', "xgrammar") == Text()
    assert load_structure('{"lit": "a"}', "xgrammar") == Lit("a")
    assert triggers(Lit("a")) == []


def test_validate_needs_no_vocabulary_and_outlines_skips_special_tokens() -> None:
    validate(structure({"seq": [{"token": 123456}, {"json": {"type": "integer"}}]}))
    vocabulary = make_vocabulary(VOCAB)
    assert vocabulary.get(SPECIAL_BYTES) is None and vocabulary.get(b"ab") == [8]


def test_mask_of_a_token_position_holds_only_that_token(backend: XGrammarBackend) -> None:
    matcher = backend.compile(structure({"seq": [{"lit": "<"}, {"token": 5}]})).matcher([STOP])
    assert matcher.advance(2)
    bitmask = torch.zeros((1, 1), dtype=torch.int32)
    matcher.fill_mask(bitmask, 0)
    assert [t for t in range(len(VOCAB)) if int(bitmask[0, 0]) >> t & 1] == [5]
