"""Worker service: the model on one device, its KV pages, forward steps and sampling."""
