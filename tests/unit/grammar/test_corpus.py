"""Every corpus schema on every backend that accepts it: random masked walks over the real
vocabulary end on a stop token with JSON that validates (formats included) and is written in our
style; a backend that cannot enforce a schema says so, naming the keyword. Every UNSUPPORTED
schema is refused by every backend, by check_schema and by validate()."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from libs.grammar import BACKENDS, validate
from libs.grammar.backend import GrammarError
from libs.grammar.cache import GrammarCache
from libs.grammar.schema_check import check_schema
from libs.protocol.messages import StructuredOutput, StructuredOutputKind
from tests.grammar_corpus import SCHEMAS, UNSUPPORTED, CorpusSchema
from tests.unit.grammar.walk import WalkVocab, assert_json_style, walk

FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
WALKS = {"xgrammar": 3, "outlines": 2}  # outlines masks cost more per step


def constraint(schema: object, backend: str) -> StructuredOutput:
    return StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(schema), backend)


def test_corpus_shape() -> None:
    assert len(SCHEMAS) >= 36
    assert len({entry.name for entry in SCHEMAS}) == len(SCHEMAS)
    for entry in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(entry.schema)
        assert set(entry.rejected_by) <= set(BACKENDS)
    assert sum(not entry.rejected_by for entry in SCHEMAS) >= 24  # most run on both backends


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", SCHEMAS, ids=[entry.name for entry in SCHEMAS])
def test_walks_validate(
    entry: CorpusSchema,
    backend: str,
    caches: dict[str, GrammarCache],
    walk_vocab: WalkVocab,
    stop_ids: tuple[int, ...],
) -> None:
    if backend in entry.rejected_by:
        with pytest.raises(GrammarError, match=re.escape(entry.rejected_by[backend])):
            caches[backend].get(constraint(entry.schema, backend))
        return
    compiled = caches[backend].get(constraint(entry.schema, backend))
    for seed in range(WALKS[backend]):
        token_ids = walk(compiled.matcher(stop_ids), walk_vocab, stop_ids, random.Random(seed))
        assert token_ids[-1] in stop_ids
        text = walk_vocab.text(token_ids[:-1])
        assert_json_style(text)
        jsonschema.validate(json.loads(text), entry.schema, format_checker=FORMATS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rejections_agree_with_validate(backend: str) -> None:
    """The gateway's validate() refuses exactly what the worker's compile refuses (corpus-wide)."""
    for entry in SCHEMAS:
        if backend in entry.rejected_by:
            with pytest.raises(GrammarError, match=re.escape(entry.rejected_by[backend])):
                validate(constraint(entry.schema, backend))
        else:
            validate(constraint(entry.schema, backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "schema,fragment", UNSUPPORTED, ids=[f"unsupported{i}" for i in range(len(UNSUPPORTED))]
)
def test_unsupported_is_refused(schema: object, fragment: str, backend: str) -> None:
    with pytest.raises(GrammarError) as checked:
        check_schema(schema, backend)
    assert fragment in str(checked.value)
    with pytest.raises(GrammarError) as validated:
        validate(constraint(schema, backend))
    assert fragment in str(validated.value)
