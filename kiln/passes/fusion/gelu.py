"""Fusion: gelu (being written)."""
