"""One OpDef per operator, grouped by family. Importing this package fills kiln.ir.REGISTRY."""

from kiln.ops import math  # noqa: F401
from kiln.ops import tensor  # noqa: F401
from kiln.ops import nn  # noqa: F401
from kiln.ops import reduce  # noqa: F401
from kiln.ops import quant  # noqa: F401
from kiln.ops import control  # noqa: F401
from kiln.ops import text_ml  # noqa: F401
from kiln.ops import signal  # noqa: F401
from kiln.ops import rnn  # noqa: F401
from kiln.ops import attention  # noqa: F401
from kiln.ops import random  # noqa: F401
from kiln.ops import vision  # noqa: F401
from kiln.ops import fused_conv  # noqa: F401
from kiln.ops import fused_transformer  # noqa: F401

from kiln.ir import REGISTRY  # noqa: E402

__all__ = ["REGISTRY"]
