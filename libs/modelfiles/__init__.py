"""Model files without torch: where a model is, what it is (architecture, shape, KV spec), its fingerprint."""

from collections.abc import Iterable


def require_positive(config: object, names: Iterable[str]) -> None:
    """ValueError naming the first of ``names`` whose value on ``config`` is not positive."""
    for name in names:
        value = getattr(config, name)
        if value <= 0:
            raise ValueError(f"{type(config).__name__}.{name} must be positive, got {value}")
