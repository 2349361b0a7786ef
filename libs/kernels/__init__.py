"""Fused ops of a model step: a plain-torch reference per op (fast CPU/CUDA variants come beside them)."""

import functools
import importlib.util


@functools.cache
def flashinfer_available() -> bool:
    """Whether flashinfer is installed: its CUDA paths are taken only then (plain torch otherwise)."""
    return importlib.util.find_spec("flashinfer") is not None
