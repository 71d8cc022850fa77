"""Strings, text features, image decoding, the ai.onnx.ml classic-ML ops and the
ai.onnx.preview.training optimizers.

These rarely sit on a model's hot path with symbolic shapes, so most keep rule ``None`` and the
frontend falls back to ONNX's own inference.
"""

from kiln.ir import DType, InferCtx
from kiln.ops.rules import broadcast, same, same_shape, tensor
from kiln.ops.schema import onnx_op

ML = "ai.onnx.ml"
TRAINING = "ai.onnx.preview.training"

# -- strings --------------------------------------------------------------------------------
StringNormalizer = onnx_op("StringNormalizer", None)
StringSplit = onnx_op("StringSplit", None)
StringConcat = onnx_op("StringConcat", broadcast(DType.string))
RegexFullMatch = onnx_op("RegexFullMatch", same_shape(DType.bool))
TfIdfVectorizer = onnx_op("TfIdfVectorizer", None)
ImageDecoder = onnx_op("ImageDecoder", None)


# -- ai.onnx.ml -----------------------------------------------------------------------------
def _tree_rule(ctx: InferCtx):
    shape = ctx.shape(0)
    batch = shape[0] if shape is not None and len(shape) else None
    return [tensor(ctx.dtype(0), (batch, ctx.attrs.n_targets))]


def _array_feature_rule(ctx: InferCtx):
    shape, idx = ctx.shape(0), ctx.shape(1)
    if shape is None or idx is None:
        return [tensor(ctx.dtype(0), None)]
    n = 1
    for d in idx:
        n = None if n is None or d is None else n * d
    lead = (1,) if len(shape) == 1 else tuple(shape[:-1])
    return [tensor(ctx.dtype(0), lead + (n,))]


LabelEncoder = onnx_op("LabelEncoder", None, domain=ML)
TreeEnsemble = onnx_op("TreeEnsemble", _tree_rule, domain=ML)
ArrayFeatureExtractor = onnx_op("ArrayFeatureExtractor", _array_feature_rule, domain=ML)
Binarizer = onnx_op("Binarizer", same(), domain=ML)
Scaler = onnx_op("Scaler", same_shape(DType.float32), domain=ML)
Normalizer = onnx_op("Normalizer", same_shape(DType.float32), domain=ML)
Imputer = onnx_op("Imputer", same(), domain=ML)


# -- ai.onnx.preview.training ---------------------------------------------------------------
def _optimizer_rule(groups: int):
    """Optimizers read R, T and ``groups`` equally long lists of tensors (X, G, state...) and
    write the updated X and state lists, each shaped like X."""
    def rule(ctx: InferCtx):
        n = (len(ctx.in_types) - 2) // groups
        xs = [ctx.type(2 + i) for i in range(n)]
        return xs * (ctx.n_out // max(n, 1))
    return rule


Adagrad = onnx_op("Adagrad", _optimizer_rule(3), domain=TRAINING)
Adam = onnx_op("Adam", _optimizer_rule(4), domain=TRAINING)
Momentum = onnx_op("Momentum", _optimizer_rule(3), domain=TRAINING)
