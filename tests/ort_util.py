"""What tests that call onnxruntime's quantizer share."""

from __future__ import annotations


def calibration_reader(batches):
    """onnxruntime's ``CalibrationDataReader`` over ``batches`` (``{input name: array}``
    dicts), for ``quantize_static``."""
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._batches = iter(batches)

        def get_next(self):
            return next(self._batches, None)

    return Reader()
