"""Model definitions and weight loaders (llama family; GGUF)."""
