"""deepinfer bench's workloads: length distributions, the three workloads' sessions, and the claim
that a prompt of N words is N tokens (checked on SmolLM2's real vocabulary)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from deepinfer.bench.workloads import AGENT_SYSTEM, CODE_EDITS, WORDS, Lengths, build
from libs.modelfiles.registry import resolve_model_path
from libs.recipe.tokenizer import Tokenizer


def test_lengths_parse_fixed_and_uniform() -> None:
    assert Lengths.parse("128") == Lengths(128, 128)
    assert Lengths.parse("64:256") == Lengths(64, 256)
    assert str(Lengths.parse("7")) == "7" and str(Lengths.parse("1:3")) == "uniform 1:3"
    for bad in ("", "x", "0", "9:3", "1:2:3"):
        with pytest.raises(ValueError):
            Lengths.parse(bad)


def test_uniform_draws_cover_both_ends_and_nothing_else() -> None:
    drawn = Lengths(3, 6).draw(np.random.default_rng(0), 2000)
    assert set(drawn) == {3, 4, 5, 6}
    assert Lengths(5, 5).draw(np.random.default_rng(0), 10) == [5] * 10


def test_synthetic_prompts_have_the_drawn_lengths_and_follow_the_seed() -> None:
    sessions = build("synthetic", 50, Lengths(10, 20), Lengths(4, 8), seed=1)
    assert len(sessions) == 50 and all(len(s.turns) == 1 and s.system is None for s in sessions)
    turns = [s.turns[0] for s in sessions]
    assert all(10 <= len(t.user.split()) <= 20 and 4 <= t.max_tokens <= 8 for t in turns)
    assert all(set(t.user.split()) <= set(WORDS) for t in turns)
    assert len({t.user for t in turns}) == 50  # distinct prompts: no shared prefixes to cache
    assert build("synthetic", 50, Lengths(10, 20), Lengths(4, 8), seed=1) == sessions
    assert build("synthetic", 50, Lengths(10, 20), Lengths(4, 8), seed=2) != sessions


def test_agent_conversations_add_up_to_the_requests_asked_for() -> None:
    sessions = build("agent", 10, Lengths(30, 30), Lengths(16, 16), seed=0, turns=4)
    assert [len(s.turns) for s in sessions] == [4, 4, 2]
    assert all(s.system == AGENT_SYSTEM for s in sessions)  # a prefix every conversation shares
    first, later = sessions[0].turns[0], sessions[0].turns[1]
    assert first.user.startswith("Task 0.0: ") and later.user.startswith("Tool result 0.1: ")
    assert all(len(t.user.split(": ", 1)[1].split()) == 30 for s in sessions for t in s.turns)
    assert all(t.max_tokens == 16 for s in sessions for t in s.turns)


def test_code_edit_sends_predictions_only_when_asked() -> None:
    plain = build("code-edit", 7, Lengths(1, 1), Lengths(64, 64), seed=0)
    predicted = build("code-edit", 7, Lengths(1, 1), Lengths(64, 64), seed=0, prediction=True)
    assert all(s.turns[0].prediction is None for s in plain)
    assert [s.turns[0].prediction for s in predicted] == [CODE_EDITS[i % 5].prediction for i in range(7)]
    assert len({s.turns[0].user for s in plain}) == 7  # the snippets come round again, numbered
    assert CODE_EDITS[2].message in plain[2].turns[0].user
    assert "LIMIT 100" in (CODE_EDITS[2].prediction or "")


def test_an_unknown_workload_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        build("chat", 1, Lengths(1, 1), Lengths(1, 1), seed=0)


def test_each_word_is_one_token_in_smollm2s_vocabulary(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_gguf(resolve_model_path("smollm2"), tmp_path)
    assert [w for w in WORDS if len(tokenizer.encode_plain(" " + w)) != 1] == []
    prompt = build("synthetic", 1, Lengths(300, 300), Lengths(1, 1), seed=3)[0].turns[0].user
    assert len(tokenizer.encode_plain(prompt)) == 300
