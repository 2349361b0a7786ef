"""Long-term KV storage: chained block hashes (the cache key) and the one-file-per-block G3 format."""
