"""Fusion: qkv (being written)."""
