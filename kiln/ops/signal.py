"""Signal processing ops: DFT, STFT, window functions, mel filter banks.

None of these appear in the hot path of typical exported models, so their shape rules fall back
to ONNX's own inference.
"""

from kiln.ops.schema import onnx_op

DFT = onnx_op("DFT", None)
STFT = onnx_op("STFT", None)
HannWindow = onnx_op("HannWindow", None)
HammingWindow = onnx_op("HammingWindow", None)
BlackmanWindow = onnx_op("BlackmanWindow", None)
MelWeightMatrix = onnx_op("MelWeightMatrix", None)
