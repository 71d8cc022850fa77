"""Fusion: matmul_add (being written)."""
