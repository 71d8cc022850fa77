"""kiln's bench suite: kiln and its peers side by side, in one process, on identical inputs.

    python -m bench.run --device cpu --markdown

See docs/bench.md for what is measured and how.
"""
