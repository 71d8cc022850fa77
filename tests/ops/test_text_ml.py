"""String, text-feature, ai.onnx.ml, training and random ops, compared with onnx.reference
or NumPy."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, numpy_helper

from kiln.errors import KilnError
from tests.ops.harness import (
    assert_close,
    check_against_reference,
    node_model,
    run_kiln,
    run_reference,
)

ML = "ai.onnx.ml"
TRAIN = "ai.onnx.preview.training"


def _str(*xs):
    return np.array(xs, dtype=object)


@pytest.mark.parametrize("attrs", [
    {"case_change_action": "LOWER", "is_case_sensitive": 0, "stopwords": ["monday"]},
    {"case_change_action": "UPPER", "is_case_sensitive": 1, "stopwords": ["Monday"]},
    {"case_change_action": "NONE", "stopwords": ["a", "b"]},
])
def test_string_normalizer(attrs):
    x = _str("Monday", "tuesday", "a", "MONDAY")
    m = node_model("StringNormalizer", {"x": x}, **attrs)
    # the reference answers with a numpy str_ array; ONNX strings are object arrays here
    assert_close(run_kiln(m, {"x": x})[0], run_reference(m, {"x": x})[0].astype(object))


def test_string_normalizer_all_dropped_gives_one_empty_string():
    x = _str("a", "b").reshape(1, 2)
    got = run_kiln(node_model("StringNormalizer", {"x": x}, stopwords=["a", "b"]), {"x": x})
    assert got[0].shape == (1, 1) and got[0][0, 0] == ""


@pytest.mark.parametrize("attrs", [{}, {"delimiter": "-"}, {"delimiter": "-", "maxsplit": 1}])
def test_string_split(attrs):
    x = _str("a-b-c", "  de f", "", "g--h").reshape(2, 2)
    check_against_reference(node_model("StringSplit", {"x": x}, n_out=2, **attrs), {"x": x})


def test_string_concat_broadcasts():
    a, b = _str("x", "yé"), _str("!")
    check_against_reference(node_model("StringConcat", {"a": a, "b": b}), {"a": a, "b": b})


def test_regex_full_match():
    x = _str("ab12", "ab", "12ab").reshape(3, 1)
    check_against_reference(node_model("RegexFullMatch", {"x": x}, pattern=r"[a-z]+\d*"),
                            {"x": x})


@pytest.mark.parametrize("mode,pool", [("TF", "ints"), ("IDF", "ints"), ("TFIDF", "strings")])
def test_tfidf_vectorizer(mode, pool):
    ints = [2, 3, 5, 4, 5, 6, 7, 8, 6, 7]
    attrs = {"mode": mode, "min_gram_length": 1, "max_gram_length": 2, "max_skip_count": 2,
                 "ngram_counts": [0, 4], "ngram_indexes": [0, 1, 2, 3, 4, 5, 6],
                 "weights": [1.0, 2.0, 0.5, 1.0, 3.0, 1.5, 2.0]}
    x = np.array([[1, 1, 3, 3, 3, 7], [8, 6, 7, 5, 6, 8]], dtype=np.int32)
    if pool == "ints":
        attrs["pool_int64s"] = ints
    else:
        attrs["pool_strings"] = [str(v) for v in ints]
        x = x.astype(str).astype(object)
    m = node_model("TfIdfVectorizer", {"x": x}, **attrs)
    check_against_reference(m, {"x": x})


def test_image_decoder_png():
    pil = pytest.importorskip("PIL.Image")
    import io
    img = (np.arange(4 * 5 * 3) % 256).astype(np.uint8).reshape(4, 5, 3)
    buf = io.BytesIO()
    pil.fromarray(img).save(buf, format="PNG")
    data = np.frombuffer(buf.getvalue(), dtype=np.uint8)
    for fmt, want in (("RGB", img), ("BGR", img[:, :, ::-1])):
        got = run_kiln(node_model("ImageDecoder", {"x": data}, pixel_format=fmt), {"x": data})
        assert_close(got[0], np.ascontiguousarray(want))


def test_label_encoder_string_to_int_and_tensor_mapping():
    x = _str("a", "c", "b", "z")
    m = node_model("LabelEncoder", {"x": x}, domain=ML, keys_strings=["a", "b", "c"],
                   values_int64s=[1, 2, 3], default_int64=-7)
    m.opset_import[1].version = 4
    check_against_reference(m, {"x": x})
    xi = np.array([[3, 1], [9, 2]], np.int64)
    keys = numpy_helper.from_array(np.array([1, 2, 3], np.int64))
    vals = numpy_helper.from_array(np.array([0.5, 1.5, 2.5], np.float32))
    dflt = numpy_helper.from_array(np.array(-1.0, np.float32))
    m = node_model("LabelEncoder", {"x": xi}, domain=ML, keys_tensor=keys, values_tensor=vals,
                   default_tensor=dflt)
    m.opset_import[1].version = 4
    check_against_reference(m, {"x": xi})


def test_array_feature_extractor_and_binarizer():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    idx = np.array([3, 0], np.int64)
    m = node_model("ArrayFeatureExtractor", {"x": x, "i": idx}, domain=ML)
    check_against_reference(m, {"x": x, "i": idx})
    check_against_reference(node_model("Binarizer", {"x": x}, domain=ML, threshold=5.0),
                            {"x": x})


def _tree_model(x, aggregate, membership=False):
    # two trees: a 3-node tree on feature 0 and a stump on feature 1 (or a set test)
    t = numpy_helper.from_array
    modes = [0, 0, 6 if membership else 3]
    attrs = {
        "nodes_featureids": [0, 0, 1], "nodes_modes": t(np.array(modes, np.uint8)),
        "nodes_splits": t(np.array([1.0, 0.0, 2.0], np.float32)),
        "nodes_truenodeids": [1, 0, 2], "nodes_trueleafs": [0, 1, 1],
        "nodes_falsenodeids": [2, 1, 3], "nodes_falseleafs": [1, 1, 1],
        "leaf_targetids": [0, 1, 0, 1], "n_targets": 2,
        "leaf_weights": t(np.array([1.0, 2.0, 3.0, 4.0], np.float32)),
        "tree_roots": [0, 2], "aggregate_function": aggregate, "post_transform": 0}
    if membership:
        attrs["membership_values"] = t(np.array([2.0, 5.0, np.nan], np.float32))
    m = node_model("TreeEnsemble", {"x": x}, domain=ML, **attrs)
    m.opset_import[1].version = 5
    return m


@pytest.mark.parametrize("aggregate,membership", [(1, False), (0, False), (3, True)])
def test_tree_ensemble(aggregate, membership):
    x = np.array([[0.5, 2.0], [3.0, 5.0], [-1.0, np.nan], [1.0, 0.0]], np.float32)
    check_against_reference(_tree_model(x, aggregate, membership), {"x": x})


def _optimizer_inputs(n_groups, rng):
    x = rng.standard_normal(4).astype(np.float32)
    feeds = {"r": np.array(0.1, np.float32), "t": np.array(3, np.int64), "x": x}
    for name in ("g", "v", "h")[:n_groups - 1]:
        feeds[name] = rng.standard_normal(4).astype(np.float32) ** 2
    return feeds


@pytest.mark.parametrize("op,groups,n_out,attrs", [
    ("Adagrad", 3, 2, {"decay_factor": 0.1, "epsilon": 1e-6, "norm_coefficient": 0.01}),
    ("Adam", 4, 3, {"alpha": 0.9, "beta": 0.99, "epsilon": 1e-6, "norm_coefficient": 0.01,
                        "norm_coefficient_post": 0.02}),
    ("Momentum", 3, 2, {"alpha": 0.9, "beta": 0.5, "norm_coefficient": 0.01, "mode": "nesterov"}),
    ("Momentum", 3, 2, {"alpha": 0.9, "beta": 0.5, "norm_coefficient": 0.01, "mode": "standard"}),
])
def test_training_optimizers(op, groups, n_out, attrs):
    feeds = _optimizer_inputs(groups, np.random.default_rng(0))
    m = node_model(op, feeds, n_out=n_out, domain=TRAIN, **attrs)
    # the reference keeps Adam's moments in float64 for one tensor; ONNX keeps V and H's type
    for got, want in zip(run_kiln(m, feeds), run_reference(m, feeds)):
        assert_close(got, np.asarray(want).astype(np.float32))


def test_random_ops_shapes_dtypes_and_seed():
    m = node_model("RandomNormal", {}, shape=[3, 4], dtype=TensorProto.DOUBLE, seed=1.0)
    a, b = run_kiln(m, {})[0], run_kiln(m, {})[0]
    assert a.shape == (3, 4) and a.dtype == np.float64
    np.testing.assert_array_equal(a, b)  # a seeded node is reproducible across engines
    x = np.full((2, 5), 0.5, np.float32)
    u = run_kiln(node_model("RandomUniformLike", {"x": x}, low=2.0, high=3.0), {"x": x})[0]
    assert u.shape == (2, 5) and u.dtype == np.float32 and ((u >= 2) & (u <= 3)).all()
    p = np.array([0.0, 1.0, 0.0, 1.0])
    bern = run_kiln(node_model("Bernoulli", {"p": p}), {"p": p})[0]
    assert_close(bern, p)  # probabilities 0 and 1 are deterministic
    logits = np.log(np.array([[1e-9, 1.0]], np.float32))
    draws = run_kiln(node_model("Multinomial", {"l": logits}, sample_size=6), {"l": logits})[0]
    assert draws.dtype == np.int32 and draws.shape == (1, 6) and (draws == 1).all()


def test_tfidf_rejects_unknown_mode():
    x = np.array([1, 2], np.int64)
    m = node_model("TfIdfVectorizer", {"x": x}, mode="BM25", min_gram_length=1,
                   max_gram_length=1, max_skip_count=0, ngram_counts=[0],
                   ngram_indexes=[0, 1], pool_int64s=[1, 2])
    with pytest.raises(KilnError, match="unknown mode"):
        run_kiln(m, {"x": x})


@pytest.mark.parametrize("op,attrs", [
    ("Scaler", {"offset": [1.0, 2.0, 0.0], "scale": [2.0, 0.5, 1.0]}),
    ("Normalizer", {"norm": "L2"}),
    ("Normalizer", {"norm": "L1"}),
    ("Imputer", {"imputed_value_floats": [9.0], "replaced_value_float": float("nan")}),
])
def test_simple_ml_transforms(op, attrs):
    x = np.array([[1.0, -2.0, 3.0], [np.nan, 5.0, 0.5]], np.float32)
    if op != "Imputer":
        x = np.nan_to_num(x)
    check_against_reference(node_model(op, {"x": x}, domain=ML, **attrs), {"x": x})
