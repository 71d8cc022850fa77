"""The third-party model corpus: see docs/corpus.md."""
