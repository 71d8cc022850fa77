"""PyTorch kernels for every op (the CPU backend). Importing this package registers them."""

from kiln.kernels.torch import math  # noqa: F401
from kiln.kernels.torch import tensor  # noqa: F401
from kiln.kernels.torch import nn  # noqa: F401
from kiln.kernels.torch import reduce  # noqa: F401
from kiln.kernels.torch import quant  # noqa: F401
from kiln.kernels.torch import control  # noqa: F401
from kiln.kernels.torch import text_ml  # noqa: F401
from kiln.kernels.torch import signal  # noqa: F401
from kiln.kernels.torch import rnn  # noqa: F401
from kiln.kernels.torch import attention  # noqa: F401
from kiln.kernels.torch import random  # noqa: F401
from kiln.kernels.torch import vision  # noqa: F401
from kiln.kernels.torch import fused_conv  # noqa: F401
from kiln.kernels.torch import fused_transformer  # noqa: F401
