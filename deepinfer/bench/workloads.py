"""The requests a bench run sends, as sessions: each a system prompt and turns sent one after another.

- synthetic: one turn per session, a prompt of words drawn at random, of a length drawn from
  ``--input-len``; ``max_tokens`` from ``--output-len``.
- agent: a multi-turn conversation per session. Every session shares one system prompt (an
  agent's instructions and tools); the first turn is a task, each later one a tool's result,
  ``--input-len`` words each, and each turn resends the conversation so far with the replies
  the server gave: the context grows turn by turn, and a server with prefix caching serves all
  but the new turn from cache.
- code-edit: a code snippet and an edit to make; ``--prediction`` sends the edited snippet as an
  OpenAI Predicted Output.

Lengths are in words, not tokens: the bench knows no tokenizer, so it works against any server.
The words are common English ones, each one token in the usual BPE vocabularies, so a prompt of
N words is about N tokens plus the chat template; the reports count what the server says it read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

WORKLOADS = ("synthetic", "agent", "code-edit")
_WORD_TEXT = """the of and to in is was for on are with as be at by this had not but from or have an they
    which one you were all we there can more if will out so up said what about into than them
    some could time these two may first then do any like my now over such our man me even most
    made after also did many before must through back years where much your way well down
    should because each just those people how too little state good very make world still own
    see men work long get here between both life being under never day same another know while
    last might us great old year off come since against go came right used take three small
    house water city tree river road light night hand head book word door window table green
    blue red black white open close early late north south east west bird fish stone field"""
WORDS = tuple(_WORD_TEXT.split())
AGENT_SYSTEM = (
    "You are a coding agent working in a software repository. Answer with the next step: a "
    "short plan, then one tool call. Tools: read_file(path) returns a file's text; "
    "search(pattern) returns the lines that match; run_tests(path) returns the test report; "
    "edit_file(path, old, new) replaces text in a file; list_dir(path) returns a folder's "
    "entries. Keep answers short; do not repeat a file's text back."
)


@dataclass(frozen=True, slots=True)
class Task:
    message: str  # the user message
    prediction: str | None = None  # what a client expects the output to be (code-edit)


@dataclass(frozen=True, slots=True)
class Turn:
    user: str
    max_tokens: int
    prediction: str | None = None


@dataclass(frozen=True, slots=True)
class Session:
    turns: tuple[Turn, ...]
    system: str | None = None


@dataclass(frozen=True, slots=True)
class Lengths:
    """A length distribution: ``low`` == ``high`` for a fixed length, else uniform on [low, high]."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> Lengths:
        """``"128"`` (fixed) or ``"64:256"`` (uniform, both ends included)."""
        low, _, high = text.partition(":")
        try:
            lengths = cls(int(low), int(high or low))
        except ValueError:
            raise ValueError(f"a length is N or LOW:HIGH, not {text!r}") from None
        if not 1 <= lengths.low <= lengths.high:
            raise ValueError(f"a length range needs 1 <= LOW <= HIGH, not {text!r}")
        return lengths

    def draw(self, rng: np.random.Generator, count: int) -> list[int]:
        return [int(n) for n in rng.integers(self.low, self.high + 1, size=count)]

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"uniform {self.low}:{self.high}"


def words(rng: np.random.Generator, count: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=count))


def synthetic(num_prompts: int, inputs: Lengths, outputs: Lengths, rng: np.random.Generator) -> list[Session]:
    return [
        Session((Turn(words(rng, n_in), n_out),))
        for n_in, n_out in zip(inputs.draw(rng, num_prompts), outputs.draw(rng, num_prompts), strict=True)
    ]


def agent(
    num_prompts: int, turns: int, inputs: Lengths, outputs: Lengths, rng: np.random.Generator
) -> list[Session]:
    """ceil(num_prompts / turns) conversations of ``turns`` turns (the last one shorter if it must
    be): ``num_prompts`` requests in all."""
    sessions = []
    for k in range(math.ceil(num_prompts / turns)):
        count = min(turns, num_prompts - k * turns)
        lens = zip(inputs.draw(rng, count), outputs.draw(rng, count), strict=True)
        sessions.append(
            Session(
                tuple(
                    Turn(f"{'Task' if t == 0 else 'Tool result'} {k}.{t}: {words(rng, n_in)}", n_out)
                    for t, (n_in, n_out) in enumerate(lens)
                ),
                AGENT_SYSTEM,
            )
        )
    return sessions


def code_edit(
    num_prompts: int, outputs: Lengths, rng: np.random.Generator, prediction: bool
) -> list[Session]:
    """The snippets in turn, each request numbered so no two prompts are the same text."""
    tasks = [CODE_EDITS[i % len(CODE_EDITS)] for i in range(num_prompts)]
    return [
        Session((Turn(f"Request {i}. {t.message}", n, t.prediction if prediction else None),))
        for i, (t, n) in enumerate(zip(tasks, outputs.draw(rng, num_prompts), strict=True))
    ]


def build(
    workload: str,
    num_prompts: int,
    inputs: Lengths,
    outputs: Lengths,
    seed: int,
    turns: int = 4,
    prediction: bool = False,
) -> list[Session]:
    """The sessions of ``workload``, ``num_prompts`` requests in all: the same for the same
    arguments (the seed included)."""
    rng = np.random.default_rng(seed)
    if workload == "synthetic":
        return synthetic(num_prompts, inputs, outputs, rng)
    if workload == "agent":
        return agent(num_prompts, turns, inputs, outputs, rng)
    if workload == "code-edit":
        return code_edit(num_prompts, outputs, rng, prediction)
    raise ValueError(f"unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}")


HTML = """<ul class="menu">
  <li><a href="/">Home</a></li>
  <li><a href="/about">About</a></li>
  <li><a href="/blog">Blog</a></li>
  <li><a href="/contact">Contact</a></li>
</ul>
"""
POINT = """class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def __repr__(self):
        return f'Point({self.x}, {self.y})'
"""
QUERY = """SELECT id, name, email, created_at
FROM users
WHERE active = 1
  AND country = 'FR'
ORDER BY created_at DESC
LIMIT 50;
"""
BUTTON = """.button {
  color: white;
  background: #0066cc;
  padding: 8px 16px;
  border-radius: 4px;
  font-size: 14px;
}
"""
USER = """interface User {
  id: number;
  name: string;
  email: string;
  isAdmin: boolean;
}
"""


def _edit(ask: str, lang: str, code: str, edited: str) -> Task:
    return Task(f"{ask} and show the whole code:\n\n```{lang}\n{code}```", f"```{lang}\n{edited}```")


# A snippet to edit and show whole; the prediction is the snippet with the edit done, as an
# editor sends it. bench/spec_decode.py's code-edit workload is these tasks.
CODE_EDITS = (
    _edit(
        "Add a link to /shop after Blog in this HTML", "html", HTML,
        HTML.replace("</ul>", '  <li><a href="/shop">Shop</a></li>\n</ul>'),
    ),
    _edit(
        "Add a docstring to this class", "python", POINT,
        POINT.replace("class Point:\n", 'class Point:\n    """A point in the plane."""\n\n'),
    ),
    _edit("Change the limit to 100 in this query", "sql", QUERY, QUERY.replace("LIMIT 50", "LIMIT 100")),
    _edit("Make the padding 10px 20px in this CSS", "css", BUTTON, BUTTON.replace("8px 16px", "10px 20px")),
    _edit(
        "Add an optional phone field to this TypeScript interface", "ts", USER,
        USER.replace("}", "  phone?: string;\n}"),
    ),
)  # fmt: skip
