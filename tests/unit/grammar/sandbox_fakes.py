"""Backends for the sandbox tests, built in the compiler's child process: each compile does what
its regex spec says (sleep, spin on the CPU, allocate without end, fail, or succeed)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from libs.grammar.backend import GrammarError
from libs.protocol.messages import StructuredOutput


@dataclass(frozen=True)
class FakeCompiled:
    spec: str
    vocab_size: int

    def matcher(self, stop_token_ids: Sequence[int]) -> object:
        raise NotImplementedError


class FakeBackend:
    name = "fake"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def compile(self, constraint: StructuredOutput) -> FakeCompiled:
        spec = constraint.spec
        if spec == "sleep":
            time.sleep(3600)
        elif spec == "spin":
            while True:  # a compile stuck in a loop, holding the CPU
                pass
        elif spec == "alloc":
            chunks = []
            while True:  # 16 MiB at a time: address space, which RLIMIT_AS caps
                chunks.append(bytearray(16 * 2**20))
        elif spec == "bad":
            raise GrammarError("a bad spec", "spec")
        return FakeCompiled(spec, self.vocab_size)


def missing_backend(vocab_size: int) -> FakeBackend:
    import deepinfer_no_such_module  # type: ignore[import-not-found]  # noqa: F401

    return FakeBackend(vocab_size)
