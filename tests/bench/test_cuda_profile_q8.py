"""bench.cuda_profile's INT8/FP8 summary helpers (the GPU part runs on the H200 only)."""

import numpy as np
import pytest

from bench import cuda_profile as CP


def test_agreement_cosine_and_top1():
    ref = [np.array([[1.0, 0.0, 0.0], [0.0, 2.0, 1.0]], np.float32)]
    got = [np.array([[2.0, 0.0, 0.0], [0.0, 1.0, 2.0]], np.float32)]
    a = CP.agreement(got, ref)
    assert a["top1_agreement"] == 0.5
    assert a["cosine"] == pytest.approx((1.0 + 4.0 / 5.0) / 2)


def test_agreement_without_classes_has_no_top1():
    x = [np.ones((2, 1), np.float32)]
    assert CP.agreement(x, x) == {"cosine": pytest.approx(1.0)}


def test_precision_list_is_checked():
    with pytest.raises(SystemExit):
        CP.main(["--corpus", "x", "--model", "m", "--precision", "fp16,int4"])
