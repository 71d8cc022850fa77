"""Fusion: layernorm (being written)."""
