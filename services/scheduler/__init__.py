"""Scheduler service: request lifecycle, admission, routing to workers, step plans."""
