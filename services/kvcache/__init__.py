"""KV-cache service: the long-term index of stored KV blocks, retention classes, tiers and GC of the
shared store (DESIGN.md, "KV cache"). Not built yet; the scheduler and workers run without it."""
