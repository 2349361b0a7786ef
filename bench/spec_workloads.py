"""The requests bench/spec_decode.py sends: per workload, user messages and, where a client would
have one, the prediction it sends with them (OpenAI Predicted Outputs).

- code-edit: a snippet to edit and show whole. The prediction is the snippet with the edit done,
  as an editor sends it. SmolLM2-135M mostly repeats the snippet (it seldom makes the edit), so
  its output is mostly the prompt's text: the case n-gram drafts are for.
- summarization: a passage to summarize; summaries reuse the passage's phrases.
- open-chat: open questions; answers share little with the prompt.
"""

from __future__ import annotations

from deepinfer.bench.workloads import CODE_EDITS, Task  # the code-edit snippets `deepinfer bench` sends too

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
