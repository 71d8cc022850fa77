from kiln.builder.builder import Builder
from kiln.builder.config import BuilderConfig

__all__ = ["Builder", "BuilderConfig"]
