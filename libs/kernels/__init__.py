"""Fused ops of a model step: a plain-torch reference per op (fast CPU/CUDA variants come beside them)."""
