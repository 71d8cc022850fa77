"""Errors kiln raises. Each message names the thing at fault and says what to do."""


class KilnError(Exception):
    """Base of every error kiln raises on bad input."""


class ModelLoadError(KilnError):
    """The model file could not be read (missing, malformed, unsafe external data)."""


class UnsupportedOpsError(KilnError):
    """The model uses operators kiln does not implement; lists every one of them."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(
            f"the model uses {len(problems)} unsupported node(s):\n{lines}\n"
            "Run `kiln ops` for the supported operators, or rewrite these nodes before export.")


class ShapeError(KilnError):
    """An input shape or dtype does not fit what the engine accepts."""


class EngineFileError(KilnError):
    """An engine file is not one, is damaged, or was built for something else."""


class KernelError(KilnError):
    """A kernel failed while running a node; names the node."""
