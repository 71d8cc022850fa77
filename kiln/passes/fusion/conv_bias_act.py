"""Fusion: conv_bias_act (being written)."""
