"""Triton kernels for the CUDA backend (generated pointwise chains, norms, softmax, GEMM with
fused epilogue, flash attention, cuDNN convolutions with a fused epilogue). Importing this
package registers them without importing ``triton``: a kernel makes its Triton function when
it first compiles (:mod:`kiln.kernels.triton.lazy`), so an engine run from its embedded binaries
never imports Triton.

Each kernel is registered with its tactic space and a ``supports`` predicate, and falls back to
the PyTorch kernel for inputs it does not cover, so choosing it never breaks a node.
"""

from kiln.kernels.triton import (
    attention,  # noqa: F401
    conv,  # noqa: F401
    gemm,  # noqa: F401
    int8_conv,  # noqa: F401
    int8_gemm,  # noqa: F401
    norm,  # noqa: F401
    pointwise,  # noqa: F401
    pool,  # noqa: F401
    softmax,  # noqa: F401
    squeeze_excite,  # noqa: F401
)
