"""A grammar library that does not import (a sys.modules entry set to None, in a fresh
interpreter): start-up falls back to the other backend and says so naming both, neither importing
is a clear error, and a constraint for the missing backend is a 503 (gateway: the server chose
the backend) or fails its sequence alone (worker), never an exception out of the request."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PRELUDE = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
for name in sys.argv[1:]:
    sys.modules[name] = None  # import name: ModuleNotFoundError
"""


def run(script: str, *missing: str) -> subprocess.CompletedProcess[str]:
    code = PRELUDE + textwrap.dedent(script)
    return subprocess.run(
        [sys.executable, "-c", code, *missing], capture_output=True, text=True, timeout=300, check=False
    )


def test_a_missing_backend_falls_back_to_the_other_and_says_so() -> None:
    done = run("from libs.grammar import resolve_backend; print(resolve_backend('xgrammar'))", "xgrammar")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "outlines"
    assert "grammar backend xgrammar is unavailable" in done.stderr and "using outlines" in done.stderr
    done = run(
        "from libs.grammar import resolve_backend; print(resolve_backend('outlines'))", "outlines_core"
    )
    assert done.stdout.strip() == "xgrammar" and "grammar backend outlines is unavailable" in done.stderr


def test_no_backend_at_all_is_a_clear_error() -> None:
    done = run(
        "from libs.grammar import resolve_backend; resolve_backend('xgrammar')", "xgrammar", "outlines_core"
    )
    assert done.returncode == 1
    assert (
        "RuntimeError: no grammar backend is available (xgrammar: " in done.stderr
        and "outlines: " in done.stderr
    )


def test_a_constraint_for_the_missing_backend_is_a_503_and_fails_its_sequence_alone() -> None:
    script = """
    from libs.grammar.backend import BackendUnavailable
    from libs.protocol.messages import StructuredOutput, StructuredOutputKind
    from libs.recipe.fields import ApiError
    from services.gateway.grammar_check import GrammarCheck
    from services.worker.grammar_compilers import Grammars

    constraint = StructuredOutput(StructuredOutputKind.JSON, backend="xgrammar")
    try:
        GrammarCheck([b"a", b"{", b"}"]).check(constraint, "response_format")
    except ApiError as exc:
        print(exc.status, exc.param, exc.message)
    error = Grammars([b"a", b"{", b"}"]).submit(constraint).exception(timeout=60)
    print(type(error).__name__, error)
    """
    done = run(script, "xgrammar")
    assert done.returncode == 0, done.stderr
    gateway, worker = done.stdout.strip().splitlines()
    assert (
        # The backend is the server's choice, not the client's: a 503, and the worker fails the
        # sequence alone.
        gateway.startswith("503 None structured output is unavailable: ")
        and "grammar backend xgrammar is unavailable" in gateway
    )
    assert worker.startswith(
        "BackendUnavailable grammar backend xgrammar is unavailable: ModuleNotFoundError"
    )
