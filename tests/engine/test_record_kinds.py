"""The native program's record kinds: chain.c's enum and the Python planners name each kind
with the same number, and no number has two kinds (three branches once gave 8 three meanings).
"""

import re
from pathlib import Path

from kiln.engine import (
    program,
    program_bool,
    program_gemm,
    program_int8,
    program_ops,
    program_rnn,
)

ROOT = Path(__file__).resolve().parents[2]


def _c_kinds() -> dict[str, int]:
    src = (ROOT / "kiln/native/chain.c").read_text()
    body = re.search(r"enum \{ (OP_GEMM = 1,.*?)\};", src, re.S).group(1)
    return {k: int(v) for k, v in re.findall(r"(OP_[A-Z]+) = (\d+)", body)}


def test_python_record_kinds_are_chain_cs():
    c = _c_kinds()
    assert len(set(c.values())) == len(c), c
    python = {name: getattr(mod, name) for mod in (program_ops, program_gemm, program_rnn,
                                                         program_int8, program_bool)
              for name in dir(mod) if re.fullmatch(r"OP_[A-Z]+", name)}
    python.pop("OP_TORCH", None)
    assert python == c
    assert program.OP_TORCH not in c.values()
