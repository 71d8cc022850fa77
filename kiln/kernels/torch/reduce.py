"""PyTorch kernels: reductions and classification losses."""

from __future__ import annotations

import torch

from kiln.kernels.registry import register
from kiln.kernels.torch.util import ints, unsigned_safe
from kiln.ops import reduce as R


def _dims(n, x, axes) -> list[int] | None:
    """Reduced dims (normalised, sorted); [] = no reduction (noop), None = all dims."""
    got = ints(axes) if axes is not None else list(n.a.axes or ())
    if not got:
        return [] if n.a.noop_with_empty_axes else None
    return sorted({a + x.dim() if a < 0 else a for a in got})


def _is_empty_set(x, dims) -> bool:
    if x.numel() != 0:
        return False
    all_dims = range(x.dim()) if dims is None else dims
    return any(x.shape[d] == 0 for d in all_dims)


def _out_shape(x, dims, keep: bool) -> list[int]:
    dims = set(range(x.dim()) if dims is None else dims)
    if keep:
        return [1 if i in dims else s for i, s in enumerate(x.shape)]
    return [s for i, s in enumerate(x.shape) if i not in dims]


def _float(x):
    """Integer data is reduced in float64 where ONNX's result is a real number (mean, norms)."""
    return x if x.is_floating_point() else x.to(torch.float64)


def _sum(x, dims, keep):
    return torch.sum(x, dim=dims, keepdim=keep) if dims is not None else (
        torch.sum(x).reshape([1] * x.dim() if keep else []))


def _prod(x, dims, keep):
    dims = list(range(x.dim())) if dims is None else dims
    for d in reversed(dims):  # torch.prod takes one dim at a time
        x = torch.prod(x, dim=d, keepdim=keep)
    return x


def _extreme(fn, identity):
    def red(x, dims, keep):
        if _is_empty_set(x, dims):
            # ONNX defines max/min over nothing as the identity (-inf / dtype min ...)
            return torch.full(_out_shape(x, dims, keep), identity(x.dtype), dtype=x.dtype)
        return fn(x, dim=() if dims is None else dims, keepdim=keep)
    return red


def _lowest(dt):
    if dt == torch.bool:
        return False
    return -float("inf") if dt.is_floating_point else torch.iinfo(dt).min


def _highest(dt):
    if dt == torch.bool:
        return True
    return float("inf") if dt.is_floating_point else torch.iinfo(dt).max


def _logsumexp(x, dims, keep):
    x = _float(x)
    return torch.logsumexp(x, dim=list(range(x.dim())) if dims is None else dims, keepdim=keep)


# op -> (elementwise pre-map, reduction, elementwise post-map); None = identity.
# A noop reduction (empty axes + noop_with_empty_axes) still applies pre and post.
_SPECS = {
    R.ReduceSum: (None, _sum, None),
    R.ReduceMean: (_float, lambda x, d, k: torch.mean(x, dim=d, keepdim=k) if d is not None
                   else torch.mean(x).reshape([1] * x.dim() if k else []), None),
    R.ReduceProd: (None, _prod, None),
    R.ReduceMax: (None, _extreme(torch.amax, _lowest), None),
    R.ReduceMin: (None, _extreme(torch.amin, _highest), None),
    R.ReduceL1: (torch.abs, _sum, None),
    R.ReduceL2: (lambda x: torch.square(_float(x)), _sum, torch.sqrt),
    R.ReduceSumSquare: (torch.square, _sum, None),
    R.ReduceLogSum: (_float, _sum, torch.log),
    R.ReduceLogSumExp: (None, _logsumexp, None),
}


def _reduce(op, n, x, axes=None):
    pre, red, post = _SPECS[op]
    dims = _dims(n, x, axes)
    y = pre(x) if pre else x
    if dims != []:
        y = red(y, dims, bool(n.a.keepdims))
    elif red is _logsumexp:
        y = x  # log(exp(x)) without the round trip
    y = post(y) if post else y
    return y.to(x.dtype)


def _make(op):
    @register(op)
    @unsigned_safe
    def kernel(n, x, axes=None):
        return _reduce(op, n, x, axes)
    kernel.__name__ = op.name.lower()
    return kernel


for _op in R.REDUCE_OPS:
    _make(_op)


# ---- losses ---------------------------------------------------------------------------------

def _nll(n, logp, target, weight):
    """ONNX NegativeLogLikelihoodLoss on log-probabilities ``logp`` (N, C, d1..dk)."""
    t = target.to(torch.int64)
    ii = n.a.ignore_index
    keep = t != ii if ii is not None else torch.ones_like(t, dtype=torch.bool)
    safe = torch.where(keep, t, torch.zeros_like(t))  # ignored targets may be out of range
    loss = -torch.gather(logp, 1, safe.unsqueeze(1)).squeeze(1)
    w = weight[safe] if weight is not None else torch.ones_like(loss)
    w = torch.where(keep, w, torch.zeros_like(w))
    loss = loss * w
    if n.a.reduction == "none":
        return loss
    if n.a.reduction == "sum":
        return loss.sum()
    if n.a.reduction == "mean":
        return loss.sum() / w.sum()
    raise ValueError(f"unknown reduction {n.a.reduction!r}")


@register(R.NegativeLogLikelihoodLoss)
def nll_loss(n, x, target, weight=None):
    return _nll(n, x, target, weight)


@register(R.SoftmaxCrossEntropyLoss)
def softmax_cross_entropy_loss(n, scores, labels, weights=None):
    logp = torch.log_softmax(scores, dim=1)
    loss = _nll(n, logp, labels, weights)
    return (loss, logp) if n.n_out > 1 else loss
