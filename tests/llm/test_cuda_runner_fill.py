"""The CUDA runner's one-buffer decode inputs, filled on the host (both fill paths; CPU)."""

import pytest
import torch

pytest.importorskip("triton")

from kiln.llm.cuda_runner import CudaModelRunner, _Step


class _R:
    block_size = 16


@pytest.mark.parametrize("b", [1, 3, 17, 40])  # the loop (<= 16 rows) and the numpy path
def test_fill_layout(b):
    bs, width, scratch = 16, 64, 1000
    entries = [(600 + i, 1, list(range(i * 60, i * 60 + -(-(601 + i) // bs) + i % 3)))
               for i in range(b)]
    ids, pos = [5 + i for i in range(b)], [600 + i for i in range(b)]
    s = b + 1  # one padding row
    st = _Step(s, width, scratch * bs, scratch, torch.device("cpu"))
    st.arr[:] = 7  # leftovers of an earlier step must not survive
    CudaModelRunner._fill(_R(), st, ids, pos, entries)
    a = st.dev.numpy()
    for i, (start, _, t) in enumerate(entries):
        assert (a[i], a[s + i], a[3 * s + i]) == (ids[i], pos[i], start + 1)
        assert a[2 * s + i] == t[start // bs] * bs + start % bs
        row = a[4 * s + i * width:4 * s + (i + 1) * width]
        assert list(row[:len(t)]) == t and (row[len(t):] == scratch).all()
    assert (a[b], a[2 * s + b], a[3 * s + b]) == (0, scratch * bs, 1)  # padding row
    assert (a[4 * s + b * width:] == scratch).all()
