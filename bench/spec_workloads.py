"""The requests bench/spec_decode.py sends: per workload, user messages and, where a client would
have one, the prediction it sends with them (OpenAI Predicted Outputs).

- code-edit: a snippet to edit and show whole. The prediction is the snippet with the edit done,
  as an editor sends it. SmolLM2-135M mostly repeats the snippet (it seldom makes the edit), so
  its output is mostly the prompt's text: the case n-gram drafts are for.
- summarization: a passage to summarize; summaries reuse the passage's phrases.
- open-chat: open questions; answers share little with the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Task:
    message: str  # the user message
    prediction: str | None = None  # what a client expects the output to be (code-edit)


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
WORKLOADS: dict[str, tuple[Task, ...]] = {
    "code-edit": CODE_EDITS,
    "summarization": (
        Task(
            "Summarize this passage in two sentences: The harbour town woke early. Fishing boats "
            "left before dawn, the bakery lit its ovens, and the ferry to the island ran every "
            "hour. In summer the town filled with visitors who came for the beaches and the old "
            "lighthouse."
        ),
        Task(
            "Summarize this report: Sales rose 12 percent in the third quarter, driven by strong "
            "demand for the new laptop line in Europe and Asia. Costs grew more slowly than "
            "revenue, so the operating margin improved to 18 percent. The company expects growth "
            "to continue in the fourth quarter and plans to open two new factories next year."
        ),
    ),
    "open-chat": (
        Task("Write a short story about a robot who learns to paint."),
        Task("Give me some tips for a job interview."),
        Task("Describe a walk in an old forest."),
    ),
}
