"""PyTorch kernels: strings (numpy object arrays of str), TfIdfVectorizer, ImageDecoder and the
ai.onnx.ml classic-ML ops and the ai.onnx.preview.training optimizers."""

from __future__ import annotations

import io
import operator
import re

import numpy as np
import torch

from kiln.kernels.registry import register
from kiln.kernels.torch.convert import to_numpy
from kiln.ops import text_ml as T


def _strings(x) -> np.ndarray:
    return np.asarray(x, dtype=object)


# -- strings --------------------------------------------------------------------------------

@register(T.StringNormalizer)
def string_normalizer(n, x):
    """Drops stopwords (whole elements), then changes case. Works on [C] or [1, C]; when every
    element is dropped the result is a single empty string, as ONNX specifies."""
    x = _strings(x)
    if x.ndim not in (1, 2) or (x.ndim == 2 and x.shape[0] != 1):
        raise ValueError(f"StringNormalizer takes [C] or [1, C] input, got {x.shape}")
    words = list(x.reshape(-1))
    stops = set(n.a.stopwords or ())
    if stops:
        if n.a.is_case_sensitive:
            words = [w for w in words if w not in stops]
        else:
            low = {s.lower() for s in stops}
            words = [w for w in words if w.lower() not in low]
    action = n.a.case_change_action or "NONE"
    if action == "LOWER":
        words = [w.lower() for w in words]
    elif action == "UPPER":
        words = [w.upper() for w in words]
    elif action != "NONE":
        raise ValueError(f"StringNormalizer: unknown case_change_action {action!r}")
    if not words:
        words = [""]
    out = np.array(words, dtype=object)
    return out.reshape(1, -1) if x.ndim == 2 else out


@register(T.StringSplit)
def string_split(n, x):
    x = _strings(x)
    sep = n.a.delimiter or None  # no or empty delimiter: split on runs of whitespace
    maxsplit = -1 if n.a.maxsplit is None else n.a.maxsplit
    parts = [s.split(sep, maxsplit) for s in x.reshape(-1)]
    counts = np.array([len(p) for p in parts], dtype=np.int64).reshape(x.shape)
    width = max((len(p) for p in parts), default=0)
    y = np.full((len(parts), width), "", dtype=object)
    for i, p in enumerate(parts):
        y[i, :len(p)] = p
    return y.reshape(*x.shape, width), torch.from_numpy(counts)


_concat = np.frompyfunc(operator.add, 2, 1)


@register(T.StringConcat)
def string_concat(n, a, b):
    return np.asarray(_concat(_strings(a), _strings(b)), dtype=object)


@register(T.RegexFullMatch)
def regex_full_match(n, x):
    pattern = n.cache.get("re")
    if pattern is None:
        pattern = n.cache["re"] = re.compile(n.a.pattern)
    flat = [pattern.fullmatch(s) is not None for s in _strings(x).reshape(-1)]
    return torch.tensor(flat, dtype=torch.bool).reshape(np.shape(x))


# -- TfIdfVectorizer ------------------------------------------------------------------------

def _tfidf_pool(a) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Pool n-grams grouped by length n: (n, grams [P, n] as int codes, output index [P]).
    String pools are coded by their position in a vocabulary; input strings missing from the
    pool get code -1, so they can never match."""
    pool = list(a.pool_strings) if a.pool_strings else list(a.pool_int64s or ())
    vocab = None
    if a.pool_strings:
        vocab = {s: i for i, s in enumerate(dict.fromkeys(pool))}
        pool = [vocab[s] for s in pool]
    counts = list(a.ngram_counts) + [len(pool)]
    groups, gram_id = [], 0
    for i in range(len(counts) - 1):
        size = i + 1
        items = pool[counts[i]:counts[i + 1]]
        k = len(items) // size
        if k and a.min_gram_length <= size <= a.max_gram_length:
            grams = torch.tensor(items[:k * size], dtype=torch.int64).reshape(k, size)
            idx = torch.tensor(a.ngram_indexes[gram_id:gram_id + k], dtype=torch.int64)
            groups.append((size, grams, idx))
        gram_id += k
    return groups, vocab


def _tfidf_counts(codes: torch.Tensor, groups, max_skip: int, width: int) -> torch.Tensor:
    """Counts of every pool n-gram in each row of ``codes`` [B, C], for all skip distances
    (unigrams are counted once: skipping does not change them)."""
    b, c = codes.shape
    out = torch.zeros((b, width), dtype=torch.int64)
    for size, grams, idx in groups:
        for dist in range(1, (max_skip + 1 if size > 1 else 1) + 1):
            n_start = c - (size - 1) * dist
            if n_start <= 0:
                break
            pos = torch.arange(n_start)[:, None] + torch.arange(size)[None, :] * dist
            windows = codes[:, pos]  # [B, W, n]
            hits = (windows[:, :, None, :] == grams[None, None]).all(-1).sum(1)  # [B, P]
            out.index_add_(1, idx, hits)
    return out


@register(T.TfIdfVectorizer)
def tfidf_vectorizer(n, x):
    a = n.a
    if "pool" not in n.cache:
        n.cache["pool"] = _tfidf_pool(a)
    groups, vocab = n.cache["pool"]
    width = max(a.ngram_indexes) + 1
    if vocab is not None:
        xs = _strings(x)
        codes = torch.tensor([vocab.get(s, -1) for s in xs.reshape(-1)],
                             dtype=torch.int64).reshape(xs.shape)
    else:
        codes = x.to(torch.int64)
    rows = codes.reshape(1, -1) if codes.ndim < 2 else codes
    counts = _tfidf_counts(rows, groups, a.max_skip_count, width).to(torch.float32)
    weights = torch.tensor(a.weights, dtype=torch.float32) if a.weights else None
    if a.mode == "IDF":
        counts = (counts > 0).to(torch.float32)
        counts = counts * weights if weights is not None else counts
    elif a.mode == "TFIDF" and weights is not None:
        counts = counts * weights
    elif a.mode not in ("TF", "IDF", "TFIDF"):
        raise ValueError(f"TfIdfVectorizer: unknown mode {a.mode!r}")
    return counts if codes.ndim >= 2 else counts.reshape(width)


# -- ImageDecoder ---------------------------------------------------------------------------

@register(T.ImageDecoder)
def image_decoder(n, encoded):
    try:
        import PIL.Image  # optional dependency: only this op needs it
    except ImportError as e:
        raise RuntimeError("ImageDecoder needs Pillow (pip install pillow)") from e
    data = to_numpy(encoded).astype(np.uint8).tobytes()
    img = PIL.Image.open(io.BytesIO(data))
    fmt = n.a.pixel_format
    if fmt == "Grayscale":
        return torch.from_numpy(np.array(img.convert("L"))[:, :, None].copy())
    rgb = torch.from_numpy(np.array(img.convert("RGB")))
    if fmt == "BGR":
        return rgb.flip(-1).contiguous()
    if fmt != "RGB":
        raise ValueError(f"ImageDecoder: unknown pixel_format {fmt!r}")
    return rgb


# -- ai.onnx.preview.training ---------------------------------------------------------------

def _split_groups(n, xs, groups: int) -> list[list]:
    k = (n.n_in - 2) // groups
    return [list(xs[g * k:(g + 1) * k]) for g in range(groups)]


@register(T.Adagrad)
def adagrad(n, r, t, *xs):
    a = n.a
    lr = float(r) / (1 + int(t) * a.decay_factor)
    new_x, new_h = [], []
    for x, g, h in zip(*_split_groups(n, xs, 3)):
        g = a.norm_coefficient * x + g
        h = h + g * g
        new_x.append((x - lr * g / (h.sqrt() + a.epsilon)).to(x.dtype))
        new_h.append(h)
    return tuple(new_x + new_h)


@register(T.Adam)
def adam(n, r, t, *xs):
    a = n.a
    step = int(t)
    lr = float(r)
    if step > 0:  # bias correction of both moments folded into the learning rate
        lr = lr * (1 - a.beta ** step) ** 0.5 / (1 - a.alpha ** step)
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in zip(*_split_groups(n, xs, 4)):
        g = a.norm_coefficient * x + g
        v = a.alpha * v + (1 - a.alpha) * g
        h = a.beta * h + (1 - a.beta) * g * g
        x_new = x - lr * (v / (h.sqrt() + a.epsilon))
        new_x.append(((1 - a.norm_coefficient_post) * x_new).to(x.dtype))
        new_v.append(v)
        new_h.append(h)
    return tuple(new_x + new_v + new_h)


@register(T.Momentum)
def momentum(n, r, t, *xs):
    a = n.a
    lr = float(r)
    beta = a.beta if int(t) > 0 else 1.0  # the first step takes the whole gradient
    new_x, new_v = [], []
    for x, g, v in zip(*_split_groups(n, xs, 3)):
        g = a.norm_coefficient * x + g
        v = a.alpha * v + beta * g
        if a.mode == "nesterov":
            x_new = x - lr * (g + a.alpha * v)
        elif a.mode == "standard":
            x_new = x - lr * v
        else:
            raise ValueError(f"Momentum: unknown mode {a.mode!r}")
        new_x.append(x_new.to(x.dtype))
        new_v.append(v)
    return tuple(new_x + new_v)


# -- ai.onnx.ml -----------------------------------------------------------------------------

def _first(*options):
    """The first attribute of a one-of group that the node sets."""
    return next((o for o in options if o is not None and len(o)), None)


def _label_table(a):
    """Keys, values (numpy) and the default of a LabelEncoder, whichever attributes it uses."""
    keys = _first(a.keys_tensor, a.keys_strings, a.keys_int64s, a.keys_floats)
    if a.values_tensor is not None and len(a.values_tensor):
        values = np.asarray(a.values_tensor)
        if a.default_tensor is not None:
            default = np.asarray(a.default_tensor).reshape(-1)[0]
        else:
            default = {"O": "_Unused", "i": -1}.get(values.dtype.kind, -0.0)
    elif a.values_strings:
        values, default = np.array(a.values_strings, dtype=object), a.default_string
    elif a.values_int64s:
        values, default = np.array(a.values_int64s, dtype=np.int64), a.default_int64
    else:
        values = np.array(a.values_floats or (), dtype=np.float32)
        default = a.default_float
    keys = np.asarray(keys if keys is not None else ())
    if keys.dtype.kind in "US":
        keys = keys.astype(object)
    if values.dtype.kind in "US":
        values = values.astype(object)
    return keys, values, default


def _as_output(values: np.ndarray):
    return values if values.dtype == object else torch.from_numpy(np.ascontiguousarray(values))


@register(T.LabelEncoder)
def label_encoder(n, x):
    if "table" not in n.cache:
        n.cache["table"] = _label_table(n.a)
    keys, values, default = n.cache["table"]
    if isinstance(x, torch.Tensor) and keys.dtype != object:
        # numeric keys: a sorted lookup, vectorised
        k = torch.from_numpy(keys.astype(to_numpy(x).dtype))
        order = torch.argsort(k)
        k = k[order]
        flat = x.reshape(-1)
        pos = torch.searchsorted(k, flat).clamp(max=max(len(k) - 1, 0))
        found = (k[pos] == flat) if len(k) else torch.zeros_like(flat, dtype=torch.bool)
        picked = values[order.numpy()][pos.numpy()] if len(k) else values[:0]
        out = np.where(found.numpy(), picked, np.array(default, dtype=values.dtype))
        return _as_output(out.astype(values.dtype).reshape(tuple(x.shape)))
    table = dict(zip(keys.tolist(), values.tolist()))
    xs = to_numpy(x)
    flat = [table.get(v, default) for v in xs.reshape(-1).tolist()]
    return _as_output(np.array(flat, dtype=values.dtype).reshape(xs.shape))


@register(T.ArrayFeatureExtractor)
def array_feature_extractor(n, x, idx):
    cols = idx.reshape(-1).to(torch.int64) if isinstance(idx, torch.Tensor) else idx.reshape(-1)
    lead = (1,) if x.ndim == 1 else tuple(x.shape[:-1])
    if isinstance(x, np.ndarray):
        return x[..., np.asarray(cols)].reshape(lead + (len(cols),))
    return x[..., cols].reshape(lead + (len(cols),))


@register(T.Binarizer)
def binarizer(n, x):
    return (x > n.a.threshold).to(x.dtype)


@register(T.Scaler)
def scaler(n, x):
    offset = torch.tensor(n.a.offset or (0.0,), dtype=torch.float32)
    scale = torch.tensor(n.a.scale or (1.0,), dtype=torch.float32)
    return (x.to(torch.float32) - offset) * scale


@register(T.Normalizer)
def normalizer(n, x):
    x = x.to(torch.float32)
    if n.a.norm == "MAX":
        div = x.amax(-1, keepdim=True)
    elif n.a.norm == "L1":
        div = x.abs().sum(-1, keepdim=True)
    elif n.a.norm == "L2":
        div = x.square().sum(-1, keepdim=True).sqrt()
    else:
        raise ValueError(f"Normalizer: unknown norm {n.a.norm!r}")
    return x / div


@register(T.Imputer)
def imputer(n, x):
    if x.dtype.is_floating_point:
        fill, bad = n.a.imputed_value_floats, n.a.replaced_value_float
    else:
        fill, bad = n.a.imputed_value_int64s, n.a.replaced_value_int64
    fill_t = torch.tensor(fill, dtype=x.dtype)
    bad = 0 if bad is None else bad
    mask = torch.isnan(x) if isinstance(bad, float) and np.isnan(bad) else x == bad
    return torch.where(mask, fill_t, x)
