"""Gateway service: the OpenAI-compatible HTTP front, SSE out, cancellation in."""
