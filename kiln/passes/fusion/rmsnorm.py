"""Fusion: rmsnorm (being written)."""
