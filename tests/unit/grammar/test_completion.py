"""completion_path: from random points of random walks through every corpus schema (both
backends, real vocabulary), the path it finds is accepted token by token, ends the grammar, and
gives JSON that validates, in no more tokens than one byte a token; the search leaves the
matcher's state as it was. Spelled in whole tokens, a way out is several times shorter."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from libs.grammar import BACKENDS
from libs.grammar.backend import Matcher
from libs.grammar.cache import GrammarCache
from libs.grammar.completion import Alphabet, byte_path, completion_path, next_steps, whole_tokens
from libs.protocol.messages import StructuredOutput, StructuredOutputKind
from tests.grammar_corpus import SCHEMAS, CorpusSchema
from tests.unit.grammar.test_corpus import FORMATS, constraint
from tests.unit.grammar.walk import WalkVocab, allowed_ids, assert_json_style, new_bitmask


@pytest.fixture(scope="module")
def alphabet(vocab: list[bytes]) -> Alphabet:
    return Alphabet.of(vocab)


def wander(matcher: Matcher, vocab: WalkVocab, stop_ids: tuple[int, ...], rng: random.Random) -> list[int]:
    """Up to 60 uniformly drawn allowed tokens (whole UTF-8, never a stop token): a state deep
    inside strings, numbers and nested values, as a rambling model leaves it."""
    bitmask = new_bitmask(len(vocab.tokens))
    out: list[int] = []
    for _ in range(rng.randrange(61)):
        matcher.fill_mask(bitmask, 0)
        allowed = allowed_ids(bitmask)
        allowed = allowed[~np.isin(allowed, stop_ids) & vocab.whole[allowed]]
        if not len(allowed):
            break
        token = int(allowed[rng.randrange(len(allowed))])
        assert matcher.advance(token)
        out.append(token)
    return out


def search(
    matcher: Matcher, alphabet: Alphabet, stop_ids: tuple[int, ...], vocab_size: int
) -> list[int] | None:
    """The search's answer, after checking it left the matcher's mask untouched."""
    before, after = new_bitmask(vocab_size), new_bitmask(vocab_size)
    matcher.fill_mask(before, 0)
    path = completion_path(matcher, alphabet, stop_ids[0])
    matcher.fill_mask(after, 0)
    assert bool((before == after).all()), "the search changed the matcher's state"
    return path


def finish(matcher: Matcher, alphabet: Alphabet, stop_ids: tuple[int, ...], vocab_size: int) -> list[int]:
    path = search(matcher, alphabet, stop_ids, vocab_size)
    assert path is not None, "no way to finish found"
    return path


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", SCHEMAS, ids=[entry.name for entry in SCHEMAS])
def test_path_finishes_valid_json(
    entry: CorpusSchema,
    backend: str,
    caches: dict[str, GrammarCache],
    walk_vocab: WalkVocab,
    alphabet: Alphabet,
    stop_ids: tuple[int, ...],
) -> None:
    if backend in entry.rejected_by:
        return  # refused by this backend: test_corpus asserts the refusal
    compiled = caches[backend].get(constraint(entry.schema, backend))
    for seed in range(4):
        matcher = compiled.matcher(stop_ids)
        prefix = wander(matcher, walk_vocab, stop_ids, random.Random(seed))
        path = finish(matcher, alphabet, stop_ids, len(walk_vocab.tokens))
        assert path[-1] == stop_ids[0] and stop_ids[0] not in path[:-1]
        one_byte = byte_path(matcher, alphabet, stop_ids[0])
        assert one_byte is not None and len(path) <= len(one_byte)
        for token in path:
            assert matcher.advance(token)
        assert matcher.is_terminated()
        text = walk_vocab.text(prefix + path[:-1])
        assert_json_style(text)
        jsonschema.validate(json.loads(text), entry.schema, format_checker=FORMATS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_and_ends(
    backend: str,
    caches: dict[str, GrammarCache],
    walk_vocab: WalkVocab,
    alphabet: Alphabet,
    stop_ids: tuple[int, ...],
) -> None:
    regex = StructuredOutput(StructuredOutputKind.REGEX, r"[a-z]+@[a-z]+\.(com|org)", backend)
    matcher = caches[backend].get(regex).matcher(stop_ids)
    for token in walk_vocab.tokens.index(b"ab"), walk_vocab.tokens.index(b"@"):
        assert matcher.advance(token)
    path = finish(matcher, alphabet, stop_ids, len(walk_vocab.tokens))
    assert walk_vocab.text(path[:-1]) == "n.com"  # n (as in null) is the first letter tried
    for token in path:
        assert matcher.advance(token)
    assert completion_path(matcher, alphabet, stop_ids[0]) == []  # terminated: nothing to add
    ended = caches[backend].get(constraint({"type": "integer"}, backend)).matcher(stop_ids)
    assert ended.advance(walk_vocab.tokens.index(b"7"))
    assert completion_path(ended, alphabet, stop_ids[0]) == [stop_ids[0]]  # may stop right here


@pytest.mark.parametrize("backend", BACKENDS)
def test_gives_up_past_its_limits(
    backend: str,
    caches: dict[str, GrammarCache],
    walk_vocab: WalkVocab,
    alphabet: Alphabet,
    stop_ids: tuple[int, ...],
) -> None:
    """A way out longer than max_depth (1000 items at least) is not found, and the matcher is intact."""
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 1000}
    if backend == "outlines":
        schema = {"type": "array", "items": {"enum": [1]}, "minItems": 300}  # outlines' regex stays small
    matcher = caches[backend].get(constraint(schema, backend)).matcher(stop_ids)
    assert matcher.advance(walk_vocab.tokens.index(b"["))
    assert search(matcher, alphabet, stop_ids, len(walk_vocab.tokens)) is None


def accept_all(matcher: Matcher, token_ids: list[int]) -> None:
    for token in token_ids:
        assert matcher.advance(token), token
    assert matcher.is_terminated()


@pytest.mark.parametrize("backend", BACKENDS)
def test_whole_tokens_close_a_string_in_an_object_in_an_array(
    backend: str,
    caches: dict[str, GrammarCache],
    walk_vocab: WalkVocab,
    alphabet: Alphabet,
    stop_ids: tuple[int, ...],
) -> None:
    schema = {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "tags"],
        },
    }
    matcher = caches[backend].get(constraint(schema, backend)).matcher(stop_ids)
    prefix = [walk_vocab.tokens.index(piece) for piece in (b"[", b'{"', b"name", b'":', b' "', b"Par")]
    for token in prefix:
        assert matcher.advance(token)
    path = finish(matcher, alphabet, stop_ids, len(walk_vocab.tokens))
    one_byte = byte_path(matcher, alphabet, stop_ids[0])
    assert one_byte is not None
    # The same bytes ('", "tags": [""]}]'), in tokens such as '",', ' "', 'tags', '":'
    text = walk_vocab.text(path[:-1])
    assert text == walk_vocab.text(one_byte[:-1]) and text.startswith('", "tags": [') and text.endswith("]}]")
    assert path[-1] == stop_ids[0] and len(path) <= len(one_byte) // 2
    assert all(len(walk_vocab.tokens[t]) > 1 for t in path[:2])  # '",' then ' "', not byte by byte
    accept_all(matcher, path)
    jsonschema.validate(json.loads(walk_vocab.text(prefix + path[:-1])), schema)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forced_call_is_spelled_in_the_tokens_a_model_writes(
    backend: str,
    caches: dict[str, GrammarCache],
    walk_vocab: WalkVocab,
    alphabet: Alphabet,
    stop_ids: tuple[int, ...],
) -> None:
    """A hermes call's body and its closing tag: the one-byte way out is 77 tokens, more than
    the whole call takes a model (32); the whole-token one is shorter than the model's."""
    arguments = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
    }
    schema = {
        "type": "object",
        "properties": {"name": {"const": "get_weather"}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    call = StructuredOutput(
        StructuredOutputKind.JSON_SCHEMA, json.dumps(schema), backend, suffix="\n</tool_call>"
    )
    matcher = caches[backend].get(call).matcher(stop_ids)
    path = finish(matcher, alphabet, stop_ids, len(walk_vocab.tokens))
    one_byte = byte_path(matcher, alphabet, stop_ids[0])
    assert one_byte is not None and len(one_byte) == 77
    assert len(path) < 32
    text = walk_vocab.text(path[:-1])
    assert text.endswith("}}\n</tool_call>") and b"</" in [walk_vocab.tokens[t] for t in path]
    accept_all(matcher, path)
    body = json.loads(text.removesuffix("\n</tool_call>"))
    jsonschema.validate(body["arguments"], arguments)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_next_step_leaves_a_way_out(
    backend: str,
    caches: dict[str, GrammarCache],
    walk_vocab: WalkVocab,
    alphabet: Alphabet,
    stop_ids: tuple[int, ...],
) -> None:
    """``next_steps``: each token that begins the way out's bytes, with the way out it leaves,
    finishes the grammar; the way out's own first token is among them, and shorter ones too."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    compiled = caches[backend].get(constraint(schema, backend))
    matcher = compiled.matcher(stop_ids)
    for piece in (b'{"', b"city", b'":'):
        assert matcher.advance(walk_vocab.tokens.index(piece))
    path = finish(matcher, alphabet, stop_ids, len(walk_vocab.tokens))
    assert walk_vocab.text(path[:-1]) == ' ""}'
    steps = next_steps(path, alphabet)
    assert path[0] in steps and len(steps[path[0]]) <= len(path) - 1
    assert walk_vocab.tokens.index(b" ") in steps and walk_vocab.tokens.index(b' "') in steps
    for token, rest in steps.items():
        assert rest[-1] == stop_ids[0]
        probe = compiled.matcher(stop_ids)
        for piece in (b'{"', b"city", b'":'):
            assert probe.advance(walk_vocab.tokens.index(piece))
        accept_all(probe, [token, *rest])


def test_whole_tokens_spell_with_the_fewest(vocab: list[bytes], alphabet: Alphabet) -> None:
    for text in (b'"}]', b'", "tags": []}]', b"null}\n</tool_call>", b"\xc3\xa9t\xc3"):
        spelled = whole_tokens(text, alphabet.pieces)
        assert b"".join(vocab[t] for t in spelled) == text
        greedy = []  # longest token first: never fewer than the fewest
        i = 0
        while i < len(text):
            length = max(n for n in range(1, len(text) - i + 1) if text[i : i + n] in alphabet.pieces)
            greedy.append(text[i : i + length])
            i += length
        assert len(spelled) <= len(greedy) and len(spelled) < len(text)
