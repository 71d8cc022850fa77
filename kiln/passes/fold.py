"""Pass module: fold (being written)."""
