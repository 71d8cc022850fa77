"""Fusion: conv_bn (being written)."""
