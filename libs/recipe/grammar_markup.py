"""The grammar vocabulary of a model's tokenizer: which of its tokens are call markup (reached by
id only) and the bytes every other token stands for. Pure: no torch."""

from __future__ import annotations

from libs.grammar import grammar_vocab
from libs.recipe.dsml import GRAMMAR_MARKUP
from libs.recipe.tokenizer import Tokenizer


def grammar_vocab_of(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """``libs.grammar.grammar_vocab`` with this tokenizer's markup tokens (``GRAMMAR_MARKUP``)."""
    return grammar_vocab(tokenizer, vocab_size, tokenizer.added_token_ids(GRAMMAR_MARKUP).values())
