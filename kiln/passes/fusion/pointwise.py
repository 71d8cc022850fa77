"""Fusion: pointwise (being written)."""
