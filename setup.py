"""Builds kiln's optional C kernels (kiln/native); everything else is in pyproject.toml."""

import sys

from setuptools import Extension, setup

native = []
if sys.platform.startswith("linux"):
    # Plain C loaded with ctypes. optional: without a compiler kiln installs all the same and
    # its CPU kernels fall back to the library tactics (kiln.native.why_not says so).
    sources = [f"kiln/native/{name}.c"
               for name in ("gemm", "layernorm", "attention", "winograd", "pointwise", "pool",
                            "depthwise", "conv", "chain", "rnn", "llm", "quant", "qgemm", "qconv",
                            "resize", "softmax", "team")]
    native.append(Extension("kiln.native._kernels", sources, depends=["kiln/native/kernels.h"],
                            extra_compile_args=["-O3", "-fopenmp", "-std=gnu11"],
                            extra_link_args=["-fopenmp"], optional=True))

setup(ext_modules=native)
