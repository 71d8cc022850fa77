import os

import torch

# Triton reads this when its kernels are decorated: set it before any test imports them. With
# a GPU the same small-shape tests run compiled on CUDA; without one, under the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
