"""Requests <-> prompt tokens: tokenizers, chat templates, streaming detokenization."""
