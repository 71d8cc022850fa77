"""Fusion: layout (being written)."""
