"""Fusion: attention (being written)."""
