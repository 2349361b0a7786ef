"""Model files without torch: where a model is, what it is (architecture, shape, KV spec), its fingerprint."""
