"""One OpDef per operator, grouped by family. Importing this package fills kiln.ir.REGISTRY."""

from kiln.ir import REGISTRY
from kiln.ops import (
    attention,  # noqa: F401
    control,  # noqa: F401
    dynamic_quantize_lstm,  # noqa: F401
    fused_conv,  # noqa: F401
    fused_transformer,  # noqa: F401
    int8,  # noqa: F401
    math,  # noqa: F401
    nn,  # noqa: F401
    quant,  # noqa: F401
    random,  # noqa: F401
    reduce,  # noqa: F401
    rnn,  # noqa: F401
    signal,  # noqa: F401
    tensor,  # noqa: F401
    text_ml,  # noqa: F401
    vision,  # noqa: F401
)

__all__ = ["REGISTRY"]
