from kiln.build.builder import Builder
from kiln.build.config import BuilderConfig

__all__ = ["Builder", "BuilderConfig"]
