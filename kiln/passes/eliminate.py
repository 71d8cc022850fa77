"""Pass module: eliminate (being written)."""
