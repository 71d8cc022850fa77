"""PyTorch kernels for every op (the CPU backend). Importing this package registers them."""

from kiln.kernels.torch import (
    attention,  # noqa: F401
    control,  # noqa: F401
    fused_conv,  # noqa: F401
    fused_transformer,  # noqa: F401
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
