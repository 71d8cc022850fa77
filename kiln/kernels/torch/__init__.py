"""PyTorch kernels for every op (the CPU backend). Importing this package registers them.

One module per op family; a family too large for one file continues in a second module,
listed right after it."""

from kiln.kernels.torch import (  # noqa: F401
    attention,
    attention_more,
    control,
    dynamic_quantize_lstm,
    fused_conv,
    fused_transformer,
    int8,
    low_bit_cuda,
    math,
    math_act,
    nn,
    nn_norm,
    quant,
    quant_linear,
    random,
    reduce,
    rnn,
    signal,
    squeeze_excite,
    tensor,
    tensor_more,
    text_ml,
    text_ml_tree,
    vision,
    vision_sample,
)
