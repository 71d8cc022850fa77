"""kiln: an inference optimizer and runtime for ONNX models.

    import kiln
    engine = kiln.Builder(kiln.BuilderConfig()).build("model.onnx")
    engine.save("model.kiln")
    engine = kiln.load("model.kiln")
    outputs = engine.create_context().run({"input": x})
"""

__version__ = "0.1.0"

# first, before anything imports torch: it sets OpenMP's wait policy (settings.py says why)
from kiln import settings as _settings  # noqa: F401  # isort: skip
from kiln.builder import Builder, BuilderConfig
from kiln.engine.engine import Engine, ExecutionContext, TensorInfo, load
from kiln.engine.profile import Profile
from kiln.errors import (
    EngineFileError,
    KernelError,
    KilnError,
    ModelLoadError,
    ShapeError,
    UnsupportedOpsError,
)

__all__ = [
    "Builder", "BuilderConfig", "Engine", "ExecutionContext", "TensorInfo", "Profile", "load",
    "KilnError", "ModelLoadError", "UnsupportedOpsError", "ShapeError", "EngineFileError",
    "KernelError",
]
